"""One flag, one meaning: every stack flag that `drafter`, `verifier`, `generate` or `bench`
takes resolves, alone and with no flag at all, to exactly what `serve` and `up` resolve it
to for the member that command runs (its engine options, its verifier options, its gRPC
host); and the engine options reach both engines' configs through the one factory."""

from __future__ import annotations

import dataclasses

import pytest

from chainspec.cli import build_parser
from chainspec.cluster.config import DrafterRoleConfig, StackConfig
from chainspec.commands import drafter, serve, verifier
from chainspec.commands.model_args import (
    DRAFTER_KEYS,
    ENGINE_KEYS,
    VERIFIER_KEYS,
    local_options,
)
from chainspec.commands.stack_args import stack_config
from chainspec.commands.stack_flags import STACK_FLAGS
from chainspec.engine.factory import drafter_config, verifier_config
from chainspec.engine.local import LocalOptions
from chainspec.rpc.verifier_service import VerifierOptions
from tests.unit.test_stack_flags import argv_of as flag_argv

PARSER, _ = build_parser()
ROWS = {flag.key: flag for flag in STACK_FLAGS}
# NOTE: gpu_memory_utilization needs a GPU member, which these commands get from --device
# (serve and up from --verifier-gpus): test_gpu_memory_utilization_needs_a_gpu; revision
# and download_dir only pick a Hub id's snapshot (tests/unit/test_hub.py), so over a
# directory they change no engine option
SHARED = sorted((set(DRAFTER_KEYS) | set(VERIFIER_KEYS))
                - {"gpu_memory_utilization", "revision", "download_dir"})


def argv_of(key: str, name: str | None = None) -> list[str]:
    return flag_argv(ROWS[key], name)


def by_stack(argv: list[str]) -> StackConfig:
    """What `serve` and `up` resolve `argv` to (the same, or the test fails here)."""
    by_serve = serve.resolve(PARSER.parse_args(["serve", *argv])).stack
    assert stack_config(PARSER.parse_args(["up", *argv])) == by_serve
    return by_serve


def drafter_view(argv: list[str]):
    cmd = drafter.resolve(PARSER.parse_args(["drafter", "--dry-run", *argv]))
    return cmd.local, cmd.drafter, cmd.server.host


def verifier_view(argv: list[str]):
    cmd = verifier.resolve(PARSER.parse_args(["verifier", "--dry-run", *argv]))
    return cmd.verifier, cmd.server.host


def engine_view(command: str, argv: list[str]) -> LocalOptions:
    return local_options(PARSER.parse_args([command, "--threads", "0", *argv]))


def expected_drafter(config: StackConfig):
    # NOTE: alone, a drafter's KV flags size its own pool (in a stack, the verifiers')
    local = dataclasses.replace(config.local_options("drafter"),
                                kv_cache_memory=config.kv_cache_memory,
                                kv_cache_fraction=config.kv_cache_fraction,
                                gpu_memory_utilization=config.gpu_memory_utilization)
    return local, drafter_config(local), config.host


def expected_verifier(config: StackConfig):
    return VerifierOptions.of_stack(config), config.host


def test_the_commands_take_only_rows_of_the_table() -> None:
    assert set(SHARED) | set(ENGINE_KEYS) <= set(ROWS)


@pytest.mark.parametrize("key", SHARED)
def test_a_shared_flag_resolves_as_serve_and_up_resolve_it(key, monkeypatch) -> None:
    monkeypatch.delenv("CHAINSPEC_AUTH_TOKEN", raising=False)
    argv = argv_of(key)
    config = by_stack(argv)
    views = []
    if key in DRAFTER_KEYS:
        views.append((drafter_view, expected_drafter))
    if key in VERIFIER_KEYS:
        views.append((verifier_view, expected_verifier))
    for view, expected in views:
        assert view(argv) == expected(config)
        assert view(argv) != view([]), f"{argv} changed nothing in {view.__name__}"
    if key in ENGINE_KEYS:
        for command in ("generate", "bench"):
            got = engine_view(command, argv if command == "bench" else [*argv, "--prompt", "x"])
            assert got == config.local_options("verifier")


def test_without_flags_every_command_runs_the_stacks_defaults(monkeypatch) -> None:
    monkeypatch.delenv("CHAINSPEC_AUTH_TOKEN", raising=False)
    assert drafter_view([]) == expected_drafter(StackConfig())
    assert verifier_view([]) == expected_verifier(StackConfig())
    assert engine_view("bench", []) == StackConfig().local_options("verifier")


@pytest.mark.parametrize("command,old,key", [
    ("drafter", "--max-seqs", "drafter_max_num_seqs"),  # a lone drafter's own slots
    ("drafter", "--max-num-seqs", "drafter_max_num_seqs"),
    ("drafter", "--host", "grpc_host"), ("verifier", "--host", "grpc_host"),
])
def test_the_service_commands_old_names_still_work(command, old, key) -> None:
    view = drafter_view if command == "drafter" else verifier_view
    assert view(argv_of(key, old)) == view(argv_of(key))


def test_gpu_memory_utilization_needs_a_gpu(capsys) -> None:
    """vLLM's share of TOTAL device memory: a CPU member refuses it in one line; a GPU
    member's KV budget carries it (the drafter beside it does not claim it twice)."""
    from chainspec.cli import main

    assert main(["serve", "--gpu-memory-utilization", "0.9", "--dry-run"]) == 2
    assert "gpu_memory_utilization is a share of a GPU's memory" in capsys.readouterr().err
    config = by_stack(["--gpu-memory-utilization", "0.9", "--verifier-gpus", "1"])
    assert config.local_options("verifier").kv_budget.utilization == 0.9
    assert config.local_options("drafter").kv_budget.utilization is None


def test_the_token_reaches_the_service_commands_as_it_reaches_the_stack(monkeypatch) -> None:
    monkeypatch.setenv("CHAINSPEC_AUTH_TOKEN", "tok")
    for command in ("drafter", "verifier"):
        module = drafter if command == "drafter" else verifier
        cmd = module.resolve(PARSER.parse_args([command, "--dry-run"]))
        assert cmd.server.auth_token == by_stack([]).auth_token == "tok"


def test_engine_options_reach_both_engine_configs() -> None:
    opts = LocalOptions(max_seqs=3, kv_cache_memory=1 << 20, kv_block_size=8, draft_top_k=4,
                        use_graphs=False)
    d, v = drafter_config(opts), verifier_config(opts, groups=2, draft_ahead=True)
    assert (d.top_k, d.use_graphs, d.max_seqs, d.kv) == (4, False, 3, opts.kv_budget)
    assert (v.draft_top_k, v.use_graphs, v.max_seqs, v.kv) == (4, False, 3, opts.kv_budget)
    assert (v.groups, v.draft_ahead) == (2, True)


def test_a_stack_drafter_gets_the_engine_options_and_its_own_slots_and_pool() -> None:
    config = StackConfig(draft_top_k=4, use_graphs=False, kv_block_size=8, drafter_max_seqs=5,
                         kv_cache_memory=1 << 20, drafter=DrafterRoleConfig(num_gpus=1))
    d = drafter_config(config.local_options("drafter"))
    assert (d.top_k, d.use_graphs, d.max_seqs, d.kv.block_size) == (4, False, 5, 8)
    assert d.kv.memory_bytes is None and d.kv.fraction is None  # the verifiers' budget
    assert config.local_options("drafter").device == "cuda"
    v = verifier_config(VerifierOptions.of_stack(config).model)
    assert (v.draft_top_k, v.use_graphs, v.kv.memory_bytes) == (4, False, 1 << 20)


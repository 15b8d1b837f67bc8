"""One config path for `chainspec serve` and `chainspec up`: every stack flag, alone, over
a file, and all together, resolves to the same `StackConfig` through both commands and
changes the field its row names; an empty or unreadable `--config` is refused the same
way by both; every config level is validated by the spine (spine/read.py)."""

from __future__ import annotations

import json

import pytest

from chainspec.cli import build_parser, main
from chainspec.cluster.config import StackConfig
from chainspec.commands import serve
from chainspec.commands.stack_args import stack_config
from chainspec.commands.stack_flags import STACK_FLAGS
from chainspec.gateway.config import GatewayConfig
from chainspec.serving.config import ServeConfig
from chainspec.spine.sections import (
    DrafterRoleSection,
    RoleSection,
    StackSection,
    runtime_name,
)
from chainspec.spine.sections import default as spine_default

# spine key -> a command-line value that differs from the default (None: an on/off flag,
# given as the form that is not the default; a new STACK_FLAGS row without an example
# here fails `test_every_flag_has_an_example`)
EXAMPLES = {
    "model": "/models/x", "revision": "v1", "download_dir": "/hf-cache",
    "num_speculative_tokens": "4", "chain": None,
    "speculative_config": '{"method": "mtp", "num_speculative_tokens": 2}',
    "max_num_seqs": "5", "drafter_max_num_seqs": "7", "max_model_len": "512",
    "dtype": "bfloat16", "kv_cache_memory_bytes": "1048576", "kv_cache_fraction": "0.5",
    "gpu_memory_utilization": "0.9", "block_size": "8", "draft_top_k": "4",
    "enforce_eager": None, "enable_prefix_caching": None, "state_snapshots": "12",
    "seed": "7",
    "max_waiting": "12", "grpc_host": "0.0.0.0", "namespace": "ns1",
    "health_interval_s": "2.5", "drain_timeout_s": "9", "draft_deadline_s": "0.2",
    "pipeline_groups": "2", "draft_ahead": None, "scheduling_policy": "priority",
    "speculative_depth": "adaptive", "drafter.mode": "local", "drafter.replicas": "3",
    "verifier.replicas": "2", "drafter.num_gpus": "0.5", "verifier.num_gpus": "1",
    "verifier.tensor_parallel_size": "2", "drafter.tensor_parallel_size": "2",
}
# what else an example needs to be valid: gpu_memory_utilization is a GPU member's share
NEEDS = {"gpu_memory_utilization": ("--verifier-gpus", "1")}
PARSER, _ = build_parser()


def argv_of(flag, name: str | None = None) -> list[str]:
    """The example of `flag` under `name` (default: its last, an old name if it has
    one); an on/off flag as its form that is not the default (`--no-chain`)."""
    name, value = name or flag.names[-1], EXAMPLES[flag.key]
    if value is None:
        on = not spine_default(*_section(flag.key))
        return [name if on else "--no-" + name[2:], *NEEDS.get(flag.key, ())]
    return [name, value, *NEEDS.get(flag.key, ())]


def _section(key: str):
    section, _, name = key.rpartition(".")
    return {"": StackSection, "drafter": DrafterRoleSection,
            "verifier": RoleSection}[section], name


def both(*argv: str) -> tuple[StackConfig, StackConfig]:
    """What `serve` and `up` resolve the same arguments to."""
    return (serve.resolve(PARSER.parse_args(["serve", *argv])).stack,
            stack_config(PARSER.parse_args(["up", *argv])))


def field_of(config: StackConfig, key: str):
    role, _, name = key.rpartition(".")
    if name == "speculative_config":
        return config.num_steps
    cls, _ = _section(key)
    return getattr(config.role(role) if role else config, runtime_name(cls, name))


def test_every_flag_has_an_example() -> None:
    assert sorted(f.key for f in STACK_FLAGS) == sorted(EXAMPLES)


def test_every_row_is_named_for_its_key_first() -> None:
    """vLLM's names (the config file's keys) come first; today's names follow."""
    for flag in STACK_FLAGS:
        if "." not in flag.key:
            assert flag.names[0] == "--" + flag.key.replace("_", "-"), flag


@pytest.mark.parametrize("flag", STACK_FLAGS, ids=lambda f: f.names[-1])
def test_each_flag_reaches_the_same_field_through_serve_and_up(flag, tmp_path) -> None:
    by_serve, by_up = both(*argv_of(flag))
    assert by_serve == by_up
    assert field_of(by_up, flag.key) != field_of(StackConfig(), flag.key)
    defaults = StackConfig().to_dict()
    del defaults["drafter"]["replicas"]  # its default follows drafter.mode
    path = tmp_path / "stack.yaml"  # over a file that sets the key otherwise
    path.write_text(json.dumps(defaults))
    by_serve_f, by_up_f = both("--config", str(path), *argv_of(flag))
    assert by_serve_f == by_up_f == by_up


@pytest.mark.parametrize("flag", [f for f in STACK_FLAGS if len(f.names) > 1],
                         ids=lambda f: f.names[0])
def test_every_name_of_a_flag_means_the_same(flag) -> None:
    """vLLM's flag and chainspec's alias (`--max-model-len`, `--max-len`) resolve to one
    config through serve and through up."""
    configs = {both(*argv_of(flag, name)) for name in flag.names}
    assert len(configs) == 1


def test_all_flags_together_over_a_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CHAINSPEC_AUTH_TOKEN", "tok")
    path = tmp_path / "stack.yaml"
    path.write_text("health_timeout_s: 9\ndrafter: {num_cpus: 2}\nverifier: {port: 7000}\n")
    argv = ["--config", str(path), "--token-env", "CHAINSPEC_AUTH_TOKEN"]
    for flag in STACK_FLAGS:
        if flag.key not in ("kv_cache_fraction", "drafter.replicas",  # exclusive with others
                            "kv_cache_memory_bytes",
                            "speculative_config",  # contradicts -k 4
                            "drafter.tensor_parallel_size"):  # (drafter mode local)
            argv += argv_of(flag)
    by_serve, by_up = both(*argv)
    assert by_serve == by_up
    assert (by_up.health_timeout_s, by_up.drafter.num_cpus, by_up.verifier.port) == (9, 2, 7000)
    assert by_up.auth_token == "tok" and by_up.drafter.local and not by_up.chain


def test_up_takes_host_as_grpc_host_and_serve_as_http_host() -> None:
    up = stack_config(PARSER.parse_args(["up", "--host", "0.0.0.0"]))
    args = PARSER.parse_args(["serve", "--host", "0.0.0.0"])
    assert up.host == "0.0.0.0" and serve.resolve(args).stack.host == StackConfig.host
    assert serve.resolve(args).gateway.host == "0.0.0.0"


@pytest.mark.parametrize("text,needle", [
    ("", "the file is empty"),
    ("# only a comment\n", "the file is empty"),
    ("- a\n", "expected a mapping at the top level"),
    ("num_speculative_tokens: [\n", "not YAML or JSON"),
    ("bogus: 1\n", ": unknown keys bogus"),
])
@pytest.mark.parametrize("command", ["serve", "up"])
def test_bad_files_are_refused_alike(tmp_path, capsys, command, text, needle) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    assert main([command, "--config", str(path), "--dry-run"]) == 2
    assert needle in capsys.readouterr().err
    assert main([command, "--config", str(tmp_path / "missing.yaml"), "--dry-run"]) == 2
    assert "cannot read it" in capsys.readouterr().err


@pytest.mark.parametrize("build,where", [
    (StackConfig.from_dict, "config"), (ServeConfig.from_dict, "config"),
    (GatewayConfig.from_dict, "gateway"),
    (lambda d: StackConfig.from_dict({"drafter": d}), "config: drafter"),
    (lambda d: StackConfig.from_dict({"verifier": d}), "config: verifier"),
])
def test_every_level_refuses_unknown_keys_and_non_mappings_alike(build, where) -> None:
    with pytest.raises(ValueError, match=rf"^{where}: unknown keys bogus, zz; known: "):
        build({"zz": 1, "bogus": 2})
    with pytest.raises(ValueError, match=rf"^{where}: expected a mapping, got list"):
        build([1])

"""The config spine: every bad value, through a file or a flag, is one line naming the key
and where it came from (never a traceback); old key names still work, with a warning
naming the new one; each option is declared once, and every runtime config reads its
default there."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import random
import warnings
from pathlib import Path

import pytest

from chainspec.cli import main
from chainspec.cluster import autoscale as cluster_autoscale
from chainspec.cluster import config as cluster_config
from chainspec.cluster.autoscale import AutoscalePolicy
from chainspec.cluster.config import DrafterRoleConfig, RoleConfig, StackConfig
from chainspec.engine import options as engine_options
from chainspec.engine.drafter import DrafterConfig
from chainspec.engine.factory import drafter_config, verifier_config
from chainspec.engine.options import LocalOptions
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.verifier import VerifierConfig
from chainspec.gateway import config as gateway_config
from chainspec.gateway.config import GatewayConfig
from chainspec.serving import config as serving_config
from chainspec.spine.read import DeprecatedKey
from chainspec.spine.sections import (
    AutoscaleSection,
    DrafterRoleSection,
    GatewaySection,
    RoleSection,
    Section,
    StackSection,
    default,
    inverted,
    runtime_name,
)

# (what is wrong, the file's text, the flags, what the one line must say: for the file,
# for the flags). NOTE: argparse types flag values itself, so a flag's wrong type is its
# error; quoted booleans cannot be spelled as a flag, `--enforce-eager=false` is the
# nearest mistake.
CASES = [
    ("wrong type", 'max_model_len: "4096"\n', ["--max-model-len", "4k"],
     "max_model_len: expected an integer, got the string '4096' (write it without quotes)",
     "argument --max-model-len/--max-len: invalid int value: '4k'"),
    ("wrong type, nested", "drafter: {replicas: '2'}\n", ["--verifiers", "two"],
     "drafter.replicas: expected an integer, got the string '2'",
     "argument --verifiers: invalid int value: 'two'"),
    ("quoted boolean", 'chain: "false"\n', ["--enforce-eager=false"],
     "chain: expected true or false, got the string 'false' (write it without quotes)",
     "ignored explicit argument 'false'"),
    ("quoted boolean, gateway", "gateway: {trust_request_chat_template: 'no'}\n",
     ["--no-chain=yes"], "gateway.trust_request_chat_template: expected true or false",
     "argument --chain/--no-chain: ignored explicit argument 'yes'"),
    # NOTE: no prefix matching: --max-num-seq is not read as --max-num-seqs
    ("unknown key", "max_num_seq: 8\n", ["--max-num-seq", "8"],
     "unknown keys max_num_seq; known: ", "unrecognized arguments: --max-num-seq"),
    ("unknown key, nested", "verifier: {gpus: 1}\n", ["--verifier-gpu", "1"],
     "verifier: unknown keys gpus; known: ", "unrecognized arguments: --verifier-gpu"),
    ("out of range", "max_num_seqs: 0\n", ["--max-num-seqs", "0"],
     "max_num_seqs: input should be greater than or equal to 1, got 0",
     "--max-num-seqs: input should be greater than or equal to 1, got 0"),
    ("out of range, float", "kv_cache_fraction: 1.5\n", ["--kv-cache-fraction", "1.5"],
     "kv_cache_fraction: input should be less than or equal to 1, got 1.5",
     "--kv-cache-fraction: input should be less than or equal to 1, got 1.5"),
    ("not a choice", "dtype: int4\n", ["--speculative-depth", "deep"],
     "dtype: input should be 'auto', 'float32', 'bfloat16' or 'float16', got 'int4'",
     "argument --speculative-depth: invalid choice: 'deep'"),
    ("unknown method", "speculative_config: {method: eagle}\n",
     ["--speculative-config", '{"method": "ngram"}'],
     "speculative_config: method 'eagle' is not supported",
     "--speculative-config: method 'ngram' is not supported"),
    ("unknown key, speculative_config", "speculative_config: {model: x}\n",
     ["--speculative-config", '{"num_speculative_tokens": "3"}'],
     "speculative_config: unknown keys model",
     "--speculative-config: num_speculative_tokens: expected an integer, got the string"),
]


def one_line_error(capsys, argv: list[str]) -> str:
    """What `chainspec <argv> --dry-run` printed: exit 2 and exactly one line."""
    try:
        code = main([*argv, "--dry-run"])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # no traceback, no usage block
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "up"])
@pytest.mark.parametrize("what,text,flags,in_file,by_flag", CASES, ids=[c[0] for c in CASES])
def test_a_bad_value_is_one_line_naming_the_key_and_its_source(
        tmp_path, capsys, command, what, text, flags, in_file, by_flag) -> None:
    if command == "up" and text.startswith("gateway"):
        text = "verifier: {port: 'x'}\n"  # up has no gateway: its own section instead
        in_file = "verifier.port: expected an integer, got the string 'x'"
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    line = one_line_error(capsys, [command, "--config", str(path)])
    assert str(path) in line and in_file in line, line
    line = one_line_error(capsys, [command, *flags])
    assert by_flag in line, line


def test_the_service_commands_name_the_flag_too(capsys) -> None:
    for command in ("drafter", "verifier"):
        line = one_line_error(capsys, [command, "--block-size", "0"])
        assert "--block-size: input should be greater than or equal to 1, got 0" in line


def test_old_key_names_work_with_a_warning_naming_the_new_one(tmp_path, capsys) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("max_len: 512\nmax_seqs: 3\nkv_block_size: 8\nuse_graphs: false\n"
                    "num_steps: 2\ngateway: {model_name: m}\n")
    assert main(["serve", "--config", str(path), "--dry-run"]) == 0
    captured = capsys.readouterr()
    for old, new in (("max_len", "max_model_len"), ("max_seqs", "max_num_seqs"),
                     ("kv_block_size", "block_size"), ("use_graphs", "enforce_eager"),
                     ("num_steps", "num_speculative_tokens"),
                     ("model_name", "served_model_name")):
        assert f"{old} is deprecated; use {new}" in captured.err
    new = tmp_path / "new.yaml"
    new.write_text("max_model_len: 512\nmax_num_seqs: 3\nblock_size: 8\nenforce_eager: true\n"
                   "num_speculative_tokens: 2\ngateway: {served_model_name: [m]}\n")
    assert main(["serve", "--config", str(new), "--dry-run"]) == 0
    assert captured.out == capsys.readouterr().out  # the same config
    path.write_text("max_len: 512\nmax_model_len: 256\n")
    with pytest.raises(ValueError, match="max_len and max_model_len are the same option"):
        StackConfig.from_dict({"max_len": 512, "max_model_len": 256})


def test_a_round_trip_through_the_file_form_warns_nothing() -> None:
    config = StackConfig(max_len=512, use_graphs=False, seed=3, drafter=DrafterRoleConfig(
        mode="local"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedKey)
        assert StackConfig.from_dict(config.to_dict()) == config


def test_speculative_config_sets_the_options_it_names_and_agrees_with_the_rest() -> None:
    config = StackConfig.from_dict({"speculative_config": {
        "method": "mtp", "num_speculative_tokens": 2, "chain": False, "depth": "adaptive",
        "draft_top_k": 4}})
    assert (config.num_steps, config.chain, config.speculative_depth, config.draft_top_k) \
        == (2, False, "adaptive", 4)
    assert StackConfig.from_dict({"speculative_config": {"num_speculative_tokens": 3},
                                  "num_speculative_tokens": 3}).num_steps == 3
    with pytest.raises(ValueError, match="num_speculative_tokens 2 contradicts "
                                         "num_speculative_tokens 4"):
        StackConfig.from_dict({"speculative_config": {"num_speculative_tokens": 2},
                               "num_speculative_tokens": 4})


def test_a_flag_overrides_a_files_speculative_config_and_the_other_way(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("speculative_config: {method: mtp, num_speculative_tokens: 2}\n")
    assert main(["up", "--config", str(path), "-k", "4", "--dry-run"]) == 0
    assert '"num_speculative_tokens": 4' in capsys.readouterr().out
    path.write_text("num_speculative_tokens: 2\n")
    assert main(["up", "--config", str(path), "--speculative-config",
                 '{"num_speculative_tokens": 4}', "--dry-run"]) == 0
    assert '"num_speculative_tokens": 4' in capsys.readouterr().out


# -- declared once ---------------------------------------------------------------------

RUNTIME = [(StackConfig, StackSection), (RoleConfig, RoleSection),
           (DrafterRoleConfig, DrafterRoleSection), (GatewayConfig, GatewaySection),
           (AutoscalePolicy, AutoscaleSection)]
# the fields a spine option sets in LocalOptions (an engine's options), by spine key
ENGINE = {runtime_name(StackSection, key): key for key in StackSection.model_fields}


def _runtime_default(cls, name: str):
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return list(value) if isinstance(value, tuple) else getattr(value, "value", value)


@pytest.mark.parametrize("cls,section", RUNTIME, ids=lambda c: c.__name__)
def test_every_runtime_default_is_the_spines(cls, section) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in section.model_fields:
        field = runtime_name(section, key)
        if field not in names:
            assert key == "speculative_config", f"{cls.__name__} lacks {field}"
            continue
        want = default(section, key)
        if isinstance(want, Section):  # a section: its runtime object's own test
            continue
        want = (not want) if inverted(section, key) else want
        assert _runtime_default(cls, field) == want, (cls.__name__, key)


def test_an_engines_options_default_to_the_spines() -> None:
    role = {"tensor_parallel_size", "collective_timeout_s"}
    for f in dataclasses.fields(LocalOptions):
        if f.name in role:
            assert f.default == default(RoleSection, f.name)
        elif f.name in ENGINE:
            key = ENGINE[f.name]
            want = default(StackSection, key)
            want = (not want) if inverted(StackSection, key) else want
            got = _runtime_default(LocalOptions, f.name)
            assert (str(got) if f.name == "model_dir" else got) == want, f.name
        else:
            assert f.name == "device", f"LocalOptions.{f.name} is in no spine section"


# the runtime config modules: no field there may carry its own literal default
CONFIG_MODULES = (cluster_config, cluster_autoscale, engine_options, gateway_config,
                  serving_config)
NOT_SPINE = {("LocalOptions", "device"),  # a process's --device, no stack option
             ("DrafterRoleConfig", "autoscale")}  # a policy object, its own defaults


@pytest.mark.parametrize("module", CONFIG_MODULES, ids=lambda m: m.__name__)
def test_no_runtime_config_module_writes_a_default_of_its_own(module) -> None:
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    literal = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.value, ast.Constant) \
                    and (cls.name, stmt.target.id) not in NOT_SPINE:
                literal.append(f"{cls.name}.{stmt.target.id} = {stmt.value.value!r}")
    assert not literal, f"defaults outside the spine: {literal}"


# engine config field -> the spine key whose default it takes
ENGINE_CONFIGS = {
    VerifierConfig: {"num_steps": "num_speculative_tokens", "max_seqs": "max_num_seqs",
                     "max_len": "max_model_len", "draft_top_k": "draft_top_k",
                     "use_graphs": "enforce_eager", "seed": "seed"},
    DrafterConfig: {"num_steps": "num_speculative_tokens", "chain": "chain",
                    "max_seqs": "drafter_max_num_seqs", "max_len": "max_model_len",
                    "top_k": "draft_top_k", "use_graphs": "enforce_eager"},
}


@pytest.mark.parametrize("cls", ENGINE_CONFIGS, ids=lambda c: c.__name__)
def test_the_engines_own_configs_default_to_the_spine_too(cls) -> None:
    """Once max_seqs was 16 here, 64 there and 8 in two more places."""
    tree = ast.parse(Path(inspect.getfile(cls)).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    for stmt in body.body:
        if isinstance(stmt, ast.AnnAssign) and stmt.target.id in ENGINE_CONFIGS[cls]:
            assert not isinstance(stmt.value, ast.Constant), stmt.target.id
    for name, key in ENGINE_CONFIGS[cls].items():
        want = default(StackSection, key)
        want = (not want) if inverted(StackSection, key) else want
        assert _runtime_default(cls, name) == want, name


def test_the_factory_sets_every_engine_option_so_no_engine_default_is_served() -> None:
    """A served engine's config comes from LocalOptions through the factory, which sets
    each option (a non-default value in, the same value out)."""
    opts = LocalOptions(num_steps=2, chain=False, max_seqs=3, max_len=300,
                        kv_cache_memory=1 << 20, kv_block_size=8, draft_top_k=4,
                        use_graphs=False, speculative_depth="adaptive", seed=11)
    v, d = verifier_config(opts), drafter_config(opts)
    assert (v.num_steps, v.max_seqs, v.max_len, v.draft_top_k, v.use_graphs, v.seed) == \
        (2, 3, 300, 4, False, 11)
    assert v.kv == opts.kv_budget and v.adaptive_depth
    assert (d.num_steps, d.chain, d.max_seqs, d.max_len, d.top_k, d.use_graphs) == \
        (2, False, 3, 300, 4, False)
    assert d.kv == opts.kv_budget


def test_seed_makes_the_seeds_of_unseeded_requests_repeat() -> None:
    unseeded = SamplingParams(temperature=1.0)
    draws = [[unseeded.resolve_seed(random.Random(seed)).seed for _ in range(2)]
             for seed in (7, 7, 8)]
    assert draws[0] == draws[1] != draws[2]
    assert SamplingParams(temperature=1.0, seed=5).resolve_seed(random.Random(7)).seed == 5
    assert StackConfig.from_dict({"seed": 7}).local_options("verifier").seed == 7


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoints_on_gpu(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert LocalOptions(model_dir=tmp_path).dtype == "float32"
    assert LocalOptions(model_dir=tmp_path, device="cuda").dtype == "bfloat16"
    assert LocalOptions(model_dir=tmp_path, device="cuda", dtype="float16").dtype == "float16"
    assert StackConfig().dtype == "auto"  # resolved per member, by its device

"""The command line as a vLLM user meets it: building every parser imports no heavy module
(so `--help` answers at once), no flag is read as another by prefix, a vLLM flag chainspec
cannot honour is one line naming it, `serve MODEL` is `--model`, and several served names
reach the gateway."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chainspec.cli import build_parser, main
from chainspec.commands import serve
from chainspec.commands.stack_flags import REFUSED

HEAVY = ("torch", "ray", "grpc", "transformers", "numpy", "safetensors", "tokenizers",
         "huggingface_hub", "prometheus_client", "starlette", "xgrammar")
PARSER, _ = build_parser()


def test_building_every_parser_imports_no_heavy_module() -> None:
    code = ("import sys; from chainspec.cli import build_parser; build_parser(); "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert json.loads(out.replace("'", '"')) == []


@pytest.mark.parametrize("argv", [["serve", "--api-key-fil", "k"],  # not --api-key-file
                                  ["serve", "--max-num-seq", "4"],  # not --max-num-seqs
                                  ["up", "--drafter-gpu", "1"]])  # not --drafter-gpus
def test_no_flag_is_read_as_another_by_its_prefix(argv, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--dry-run"])
    assert e.value.code == 2
    assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--quantization", "--pipeline-parallel-size",
                                  "--kv-cache-dtype", "--enable-lora"])
@pytest.mark.parametrize("command", ["serve", "up"])
def test_a_vllm_flag_chainspec_cannot_honour_is_refused_by_name(flag, command, capsys):
    value = {"--pipeline-parallel-size": "2", "--kv-cache-dtype": "fp8"}.get(flag, "awq")
    argv = [command, flag] + ([] if flag == "--enable-lora" else [value])
    with pytest.raises(SystemExit) as e:
        main([*argv, "--dry-run"])
    shown = " ".join(argv[1:])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"chainspec {command}: {shown} is not supported (") and \
        err.count("\n") == 1


def test_vllms_api_key_flag_is_refused_without_echoing_the_key(capsys) -> None:
    """Before, `--api-key sk-test` was read as `--api-key-file sk-test` (a prefix)."""
    for argv in (["serve"], ["gateway", "--verifier", "h:1"]):
        with pytest.raises(SystemExit):
            main([*argv, "--api-key", "sk-test", "--dry-run"])
        err = capsys.readouterr().err
        assert "--api-key is not supported" in err and "--api-key-file" in err
        assert "sk-test" not in err


def test_a_refused_flag_at_its_neutral_value_passes() -> None:
    assert REFUSED["--pipeline-parallel-size"][0] == "1"
    args = PARSER.parse_args(["serve", "--pipeline-parallel-size", "1", "-dp", "1",
                              "--enable-chunked-prefill"])
    assert serve.resolve(args).stack.verifier.tensor_parallel_size == 1


def test_serve_model_is_model(tmp_path, capsys) -> None:
    by_position = serve.resolve(PARSER.parse_args(["serve", "/models/m"])).stack
    by_flag = serve.resolve(PARSER.parse_args(["serve", "--model", "/models/m"])).stack
    assert by_position == by_flag and by_flag.model_dir == "/models/m"
    assert main(["serve", "/models/a", "--model", "/models/b", "--dry-run"]) == 2
    assert "MODEL /models/a and --model /models/b disagree" in capsys.readouterr().err


def test_several_served_names_reach_the_gateway() -> None:
    gateway = serve.resolve(PARSER.parse_args(
        ["serve", "--served-model-name", "a", "b"])).gateway
    assert gateway.served_model_name == ("a", "b") and gateway.model_name == "a"
    old = serve.resolve(PARSER.parse_args(["serve", "--model-name", "a"])).gateway
    assert old.served_model_name == ("a",)


def test_help_shows_vllm_names_first_and_the_aliases() -> None:
    text = " ".join(PARSER._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
                    .format_help().split())
    for names in ("--max-model-len MAX_MODEL_LEN, --max-len MAX_MODEL_LEN",
                  "--enforce-eager, --no-enforce-eager, --eager, --no-eager",
                  "--served-model-name NAME [NAME ...], --model-name NAME [NAME ...]"):
        assert names in text, names
    assert "(default: 1024)" in text and "--quantization" not in text

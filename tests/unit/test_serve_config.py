"""`chainspec serve --config` / `--dry-run` and `chainspec gateway --dry-run`: the file
schema (stack keys at the top, a gateway section), unknown keys rejected by name at every
level, flags over the file, secrets masked, and nothing started."""

from __future__ import annotations

import json

import pytest

from chainspec.cli import main
from chainspec.serving.config import ServeConfig

FILE = """
model: /models/m
num_speculative_tokens: 4
drafter: {replicas: 2, num_gpus: 0.5}
address: ray://head:10001
gateway:
  port: 9000
  max_in_flight: 8
  api_key: sk-from-file
"""


def dry_run(capsys, *argv: str) -> dict:
    assert main([*argv, "--dry-run"]) == 0
    return json.loads(capsys.readouterr().out)


def test_file_and_flags(tmp_path, capsys) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(FILE)
    out = dry_run(capsys, "serve", "--config", str(path), "--port", "9100", "--verifiers", "3")
    c = out["config"]
    assert (c["model"], c["num_speculative_tokens"], c["address"]) == ("/models/m", 4,
                                                                       "ray://head:10001")
    assert c["drafter"]["replicas"] == 2 and c["drafter"]["num_gpus"] == 0.5
    assert c["verifier"]["replicas"] == 3
    assert c["gateway"]["port"] == 9100 and c["gateway"]["max_in_flight"] == 8
    assert c["gateway"]["api_key"] == "<set>"  # never printed


def test_drafter_mode_and_pipeline_groups_from_file_and_flags(tmp_path, capsys) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("drafter: {mode: local}\npipeline_groups: 2\n")
    c = dry_run(capsys, "serve", "--config", str(path))["config"]
    assert (c["drafter"]["mode"], c["drafter"]["replicas"], c["pipeline_groups"]) == (
        "local", 0, 2)
    c = dry_run(capsys, "serve", "--drafter-mode", "local", "--pipeline-groups", "3")["config"]
    assert (c["drafter"]["mode"], c["drafter"]["replicas"], c["pipeline_groups"]) == (
        "local", 0, 3)
    c = dry_run(capsys, "serve")["config"]
    assert (c["drafter"]["mode"], c["pipeline_groups"]) == ("remote", 1)
    path.write_text("drafter: {mode: local, replicas: 1}\n")
    assert main(["serve", "--config", str(path), "--dry-run"]) == 2
    assert "drafter.replicas must be 0 with drafter.mode local" in capsys.readouterr().err


def test_defaults_and_env_key(capsys, monkeypatch) -> None:
    monkeypatch.setenv("CHAINSPEC_API_KEY", "sk-env")
    c = dry_run(capsys, "serve")["config"]
    assert (c["gateway"]["host"], c["gateway"]["port"]) == ("127.0.0.1", 8000)
    assert c["gateway"]["api_key"] == "<set>" and c["address"] is None
    assert c["drafter"]["replicas"] == 1 and c["verifier"]["replicas"] == 1
    assert c["model"].endswith("assets/demo")


@pytest.mark.parametrize("text,needle", [
    ("bogus: 1\n", ": unknown keys bogus"),
    ("gateway: {prot: 80}\n", "gateway: unknown keys prot"),
    ("drafter: {replica: 2}\n", "drafter: unknown keys replica"),
    ("gateway: {port: 70000}\n", "gateway.port: input should be less than or equal to 65535"),
    ("gateway: {max_in_flight: 0}\n", "gateway.max_in_flight"),
    ("gateway: {trust_request_chat_template: 'yes'}\n",
     "gateway.trust_request_chat_template: expected true or false, got the string 'yes'"),
    ("gateway: 3\n", "gateway: expected a mapping"),
    ("start_timeout_s: 0\n", "start_timeout_s"),
    ("- a\n", "expected a mapping at the top level"),
    ("num_speculative_tokens: [\n", "not YAML or JSON"),
])
def test_bad_files_are_refused_naming_the_key(tmp_path, capsys, text, needle) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["serve", "--config", str(path), "--dry-run"]) == 2
    assert needle in capsys.readouterr().err


def test_round_trip() -> None:
    c = ServeConfig.from_dict({"num_speculative_tokens": 2,
                               "gateway": {"api_key": "k", "port": 0}})
    assert ServeConfig.from_dict(c.to_dict()) == c
    assert c.describe()["gateway"]["api_key"] == "<set>"
    with pytest.raises(ValueError, match="gateway.api_key: must not be empty or blank"):
        ServeConfig.from_dict({"gateway": {"api_key": " "}})


def test_gateway_command_dry_run(capsys, tmp_path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-1\n")
    out = dry_run(capsys, "gateway", "--verifier", "10.0.0.1:50051", "--verifier", "h:1",
                  "--api-key-file", str(key), "--port", "0")
    assert out["verifiers"] == ["10.0.0.1:50051", "h:1"]
    assert out["gateway"]["api_key"] == "<set>" and out["gateway"]["port"] == 0
    assert main(["gateway", "--verifier", "nohostport", "--dry-run"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err


def test_request_chat_templates_are_trusted_only_when_asked(tmp_path, capsys) -> None:
    def trusted(*argv: str) -> bool:
        out = dry_run(capsys, *argv)
        return (out.get("config") or out)["gateway"]["trust_request_chat_template"]
    path = tmp_path / "serve.yaml"
    path.write_text("gateway: {trust_request_chat_template: true}\n")
    assert trusted("serve") is False and trusted("serve", "--config", str(path)) is True
    assert trusted("serve", "--trust-request-chat-template") is True
    assert trusted("gateway", "--verifier", "h:1") is False
    assert trusted("gateway", "--verifier", "h:1", "--trust-request-chat-template") is True

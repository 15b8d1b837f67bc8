"""`chainspec drafter`: dry runs resolve and validate without loading; a real run serves,
and drains and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chainspec.cli import main
from chainspec.rpc.channel import ClientOptions, make_channel
from chainspec.rpc.generated.v1 import drafter_pb2 as pb
from chainspec.rpc.generated.v1 import drafter_pb2_grpc as pb_grpc
from tests.integration.tiny_checkpoint import write_tiny_model

pytestmark = pytest.mark.timeout(120)


def _dry(capsys, *argv: str) -> dict:
    assert main(["drafter", "--dry-run", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_dry_run_prints_the_resolved_config(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CHAINSPEC_AUTH_TOKEN", raising=False)
    cfg = _dry(capsys, "--model", str(tmp_path / "nowhere"), "-k", "4", "--no-chain",
               "--max-seqs", "16", "--port", "7001", "--host", "0.0.0.0",
               "--max-message-bytes", "1048576", "--model-name", "m")
    assert cfg["model_name"] == "m" and cfg["model"]["model_dir"].endswith("nowhere")
    assert cfg["drafter"]["num_steps"] == 4 and cfg["drafter"]["chain"] is False
    assert cfg["drafter"]["max_seqs"] == 16
    assert cfg["server"]["port"] == 7001 and cfg["server"]["host"] == "0.0.0.0"
    assert cfg["server"]["max_message_bytes"] == 1048576
    assert cfg["server"]["auth_token"] is None


def test_token_comes_from_a_file_or_an_env_var_and_is_never_printed(
        capsys, tmp_path, monkeypatch) -> None:
    secret = tmp_path / "token"
    secret.write_text("hunter2\n")
    out = _dry(capsys, "--token-file", str(secret))
    assert out["server"]["auth_token"] == "<set>"
    monkeypatch.setenv("MY_TOKEN", "hunter2")
    assert _dry(capsys, "--token-env", "MY_TOKEN")["server"]["auth_token"] == "<set>"
    monkeypatch.setenv("CHAINSPEC_AUTH_TOKEN", "hunter2")
    assert _dry(capsys)["server"]["auth_token"] == "<set>"
    assert "hunter2" not in json.dumps(out)


@pytest.mark.parametrize("argv,message", [
    (["--token-env", "CHAINSPEC_NO_SUCH_VAR"], "unset or empty"),
    (["--tls-cert", "c.pem"], "tls_cert and tls_key go together"),
    (["--tls-client-ca", "ca.pem"], "needs tls_cert"),
    (["--port", "-1"], "port"),
    (["--dtype", "float32", "-k", "0"], "--num-speculative-tokens: input should be greater"),
])
def test_dry_run_rejects_bad_arguments(capsys, argv, message) -> None:
    assert main(["drafter", "--dry-run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_serves_then_drains_on_sigterm(tmp_path) -> None:
    model = write_tiny_model(tmp_path / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "CHAINSPEC_AUTH_TOKEN": "tok"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "chainspec.cli", "drafter", "--model", str(model), "-k", "2",
         "--max-len", "128", "--model-name", "tiny", "--drain-grace", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("drafter serving "), proc.stderr.read()
        address = line.split()[-1]
        channel = make_channel(address, ClientOptions(auth_token="tok"))
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        info = pb_grpc.DrafterStub(channel).Info(pb.DrafterInfoRequest(), timeout=10)
        assert (info.model_name, info.num_draft_tokens, info.num_mtp_modules) == ("tiny", 2, 1)
        channel.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "drafter draining" in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait(10)

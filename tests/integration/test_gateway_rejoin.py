"""A gateway on Ray Client (the chart's `--address ray://<head>:10001`) whose Ray Client
server goes away -- as it does with a restarted head pod -- joins the stack again through
a new session once a server answers, instead of routing on a stale membership for ever;
requests keep flowing meanwhile. On the session's Ray, in its own namespace, with a Ray
Client server and a gateway process of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import ray

from chainspec.cluster import stack
from chainspec.cluster.config import StackConfig
from chainspec.models.tokenizer import Tokenizer
from tests.integration import helpers
from tests.integration.helpers import plain_outputs, prompt_ids

pytestmark = pytest.mark.timeout(240)
NS = "chainspec-gateway-rejoin-test"
TOKENS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ClientServer:
    """A Ray Client server (proxy mode, as `ray start --head` runs it) on `port`.
    NOTE: without gRPC's fork handlers: with them, the proxy's fork of a client's
    specific server now and then segfaults in the child (exit -11, about 1 in 4 here);
    the client then waits ~40 s for a channel that never comes, and the gateway starts
    again (see start_gateway)."""

    def __init__(self, port: int) -> None:
        gcs = ray.get_runtime_context().gcs_address
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ray.util.client.server", f"--address={gcs}",
             "--host", "127.0.0.1", "--port", str(port), "--mode", "proxy"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "0"})
        helpers.wait_for(lambda: _answers(port), 30, "the Ray Client server")

    def kill(self) -> None:
        """The server and the per-client servers it spawned (ours)."""
        procs = psutil.Process(self.proc.pid).children(recursive=True) + \
            [psutil.Process(self.proc.pid)]
        for p in procs:
            p.kill()
        psutil.wait_procs(procs, timeout=10)


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


def start_gateway(argv: list[str], env: dict[str, str]) -> helpers.Process:
    """The gateway once it serves. NOTE: Ray's Client proxy now and then fails to start
    the per-client server on a loaded machine ("Initialization failure from server"); the
    gateway then exits, and, like the chart's container, is started again (3 tries)."""
    for _ in range(3):
        gateway = helpers.Process(argv, env)
        helpers.wait_for(lambda g=gateway: "gateway serving" in g.output()
                         or g.proc.poll() is not None, 120, "the gateway serving")
        if gateway.proc.poll() is None:
            return gateway
    raise AssertionError(gateway.output())


def gateways() -> list[dict]:
    return [m for m in stack.status(namespace=NS) if m["role"] == "gateway"
            and m["state"] == "ready"]


@pytest.fixture(scope="module")
def up(ray_cluster, model_dir):
    stack.up(StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=8, max_len=256,
                         health_interval_s=0.5, health_timeout_s=2.0, namespace=NS))
    yield
    stack.down(namespace=NS)


def test_gateway_rejoins_through_a_new_ray_client_session(up, model_dir):
    client_port, http_port = free_port(), free_port()
    servers = [ClientServer(client_port)]
    env = {**os.environ, "RAY_CLIENT_RECONNECT_GRACE_PERIOD": "2"}
    argv = [sys.executable, "-m", "chainspec.cli", "gateway", "--address",
            f"ray://127.0.0.1:{client_port}", "--namespace", NS, "--port", str(http_port),
            "--model", str(model_dir)]
    gateway = start_gateway(argv, env)
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    prompt = prompt_ids(model_dir, 1)[0]
    expected = Tokenizer.from_dir(model_dir).decode(plain_outputs(model_dir, [prompt], TOKENS)[0])

    def complete() -> str:
        r = httpx.post(url, json={"prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                                  "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    try:
        first = helpers.wait_for(gateways, 30, "the gateway a member")[0]["member_id"]
        helpers.wait_for(lambda: complete() == expected, 30, "a completion through it")
        servers[0].kill()  # the head pod's Ray Client server is gone
        time.sleep(4)  # past the client's reconnect grace period: its session ended
        assert complete() == expected  # the data path does not need Ray
        servers.append(ClientServer(client_port))  # the new head pod's server
        rejoined = helpers.wait_for(
            lambda: [m for m in gateways() if m["member_id"] != first], 60,
            "the gateway joined again", gateway.output)
        assert rejoined[0]["pid"] == gateway.proc.pid  # the same process, a new session
        assert complete() == expected
        assert "joined the stack again" in gateway.output()
    finally:
        gateway.proc.terminate()
        gateway.proc.wait(30)
        for s in servers:
            if s.proc.poll() is None:
                s.kill()

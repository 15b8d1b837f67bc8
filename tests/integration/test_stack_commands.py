"""Stack commands that cannot hit the wrong stack (DESIGN 4.4), run as real processes:
against a dead cluster they answer within 10 s and remove the stale state file; with no
state file and no --address they refuse and touch nothing (not even a stack that
$RAY_ADDRESS points at); every command names the stack it acted on; a local stack has a
random service token that no status output shows; and in the chart topology a gateway
killed with SIGKILL comes back into the running stack, which never stopped serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.integration.grpc_helpers import free_port, wait_until
from tests.integration.helpers import Process, plain_outputs, prompt_ids, verifier_stub

pytestmark = pytest.mark.timeout(300)
NS = "chainspec-commands"  # the embedded stack started by `chainspec up`
GW_NS = "chainspec-gateway-restart"
DEAD_ANSWER_S = 10.0
CHAINSPEC = [sys.executable, "-m", "chainspec.cli"]


def environ(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "CHAINSPEC_STATE_DIR": str(state_dir), **extra}


def cli(state_dir: Path, *args: str, timeout: float = 120.0, **extra: str):
    """`chainspec ...` in a fresh process; (result, seconds it took)."""
    t0 = time.monotonic()
    r = subprocess.run([*CHAINSPEC, *args], capture_output=True, text=True, timeout=timeout,
                       env=environ(state_dir, **extra))
    return r, time.monotonic() - t0


# -- a dead cluster ----------------------------------------------------------------------

def write_state(state_dir: Path, namespace: str, address: str, owner_pid=None) -> Path:
    path = state_dir / f"stack-{namespace}.json"
    path.write_text(json.dumps({"address": address, "namespace": namespace,
                                "owner_pid": owner_pid}))
    return path


@pytest.mark.parametrize("command", [["status"], ["down"], ["scale", "drafters", "2"]])
def test_dead_cluster_answers_fast_and_forgets_the_stale_state(tmp_path, command) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    path = write_state(tmp_path, "dead", address)
    r, took = cli(tmp_path, *command, "--namespace", "dead", timeout=60)
    assert r.returncode == 1 and took < DEAD_ANSWER_S, (took, r.stderr)
    assert f"no Ray cluster answers at {address}" in r.stderr, r.stderr
    assert "removed the stale state file" in r.stderr and not path.exists()


# -- a local (embedded) stack started by `chainspec up` ----------------------------------

@pytest.fixture(scope="module")
def embedded(tmp_path_factory, model_dir):
    """`chainspec up` in the foreground: an embedded Ray owned by that process."""
    state_dir = tmp_path_factory.mktemp("embedded-state")
    up = Process([*CHAINSPEC, "up", "--namespace", NS, "--model", str(model_dir),
                  "--max-len", "256"], environ(state_dir))
    up.wait_for("Ctrl-C stops it", 240)
    up.state_dir = state_dir
    up.state = json.loads((state_dir / f"stack-{NS}.json").read_text())
    yield up
    if up.proc.poll() is None:  # a failed test: stop it (SIGTERM: `down`, then ray.shutdown)
        up.proc.terminate()
        up.proc.wait(60)


def status_json(embedded) -> dict:
    r, _ = cli(embedded.state_dir, "status", "--namespace", NS, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


STACK_TOKEN = """
from chainspec.cluster import stack
print(stack.config(namespace={ns!r}).auth_token)
"""


def test_local_stack_has_a_random_token_that_status_never_shows(embedded) -> None:
    got = subprocess.run([sys.executable, "-c", STACK_TOKEN.format(ns=NS)],
                         capture_output=True, text=True, timeout=60,
                         env=environ(embedded.state_dir))
    token = got.stdout.strip()
    assert got.returncode == 0 and len(token) >= 32, got.stderr
    out = status_json(embedded)
    assert token not in json.dumps(out) and token not in embedded.output()
    for m in out["members"]:
        channel = verifier_stub(m["endpoint"])[0]
        health = channel.unary_unary("/grpc.health.v1.Health/Check")  # exempt: probes
        assert health(b"", timeout=10) is not None
        if m["role"] == "verifier":
            _, stub = verifier_stub(m["endpoint"])
            with pytest.raises(grpc.RpcError) as e:
                stub.Info(pb.VerifierInfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            info = stub.Info(pb.VerifierInfoRequest(), timeout=10,
                             metadata=[("authorization", f"Bearer {token}")])
            assert info.drafters == 1
        channel.close()
    # a gateway joining the stack by address reads the token from the controller
    port = free_port()
    gateway = Process([*CHAINSPEC, "gateway", "--address", embedded.state["address"],
                       "--namespace", NS, "--port", str(port)], environ(embedded.state_dir))
    try:
        gateway.wait_for("gateway serving", 120)
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert wait_until(lambda: httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 4},
                                             timeout=30).status_code == 200, 30), \
            httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30).text \
            + gateway.output()
        assert token not in gateway.output()
    finally:
        gateway.proc.terminate()
        gateway.proc.wait(60)


@pytest.mark.parametrize("command", [["status"], ["scale", "drafters", "0"], ["down"]])
def test_no_state_file_no_address_refuses_and_touches_nothing(embedded, tmp_path, command):
    before = {m["member_id"]: m["pid"] for m in status_json(embedded)["members"]}
    # no state file here, and $RAY_ADDRESS names the running stack's Ray: still refused
    r, _ = cli(tmp_path, *command, "--namespace", NS, RAY_ADDRESS=embedded.state["address"])
    assert r.returncode == 1, r.stdout
    assert "--address" in r.stderr and "--namespace" in r.stderr, r.stderr
    assert {m["member_id"]: m["pid"] for m in status_json(embedded)["members"]} == before


def test_every_command_names_the_stack_it_acted_on(embedded) -> None:
    where = f"stack {NS!r} on the Ray cluster at {embedded.state['address']}"
    r, _ = cli(embedded.state_dir, "status", "--namespace", NS)
    assert r.returncode == 0 and r.stdout.splitlines()[0] == where, r.stdout
    out = status_json(embedded)
    assert (out["address"], out["namespace"]) == (embedded.state["address"], NS)
    r, _ = cli(embedded.state_dir, "scale", "drafters", "1", "--namespace", NS, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["address"], out["namespace"], len(out["members"])) == (
        embedded.state["address"], NS, 2)
    assert where in embedded.output()  # `up` said it too
    r, _ = cli(embedded.state_dir, "down", "--namespace", NS)
    assert r.returncode == 0 and r.stdout.strip() == f"stopped {where}", r.stdout + r.stderr
    embedded.proc.wait(60)  # the owner got SIGTERM and stopped its Ray
    assert not (embedded.state_dir / f"stack-{NS}.json").exists()


def test_stopped_ray_answers_fast_and_forgets_the_stale_state(embedded) -> None:
    assert embedded.proc.poll() is not None  # the previous test stopped it
    for command in (["status"], ["down"]):
        path = write_state(embedded.state_dir, NS, embedded.state["address"],
                           embedded.state["owner_pid"])
        r, took = cli(embedded.state_dir, *command, "--namespace", NS, timeout=60)
        assert r.returncode == 1 and took < DEAD_ANSWER_S, (took, r.stderr)
        assert "removed the stale state file" in r.stderr and not path.exists(), r.stderr


# -- the chart topology: the gateway boots or joins the stack over --address ------------

def test_gateway_restart_rejoins_the_running_stack(ray_cluster, model_dir, tmp_path):
    import ray

    from chainspec.cluster import stack

    connect = f"--address {ray.get_runtime_context().gcs_address} --namespace {GW_NS}"
    cs, port = " ".join(CHAINSPEC), free_port()
    # as helm/chainspec/templates/gateway-deployment.yaml runs it
    script = (f"{cs} status {connect} || {cs} up {connect} --model {model_dir} "
              f"--max-len 256 --detach; exec {cs} gateway {connect} --port {port} "
              f"--model {model_dir}")
    prompt = prompt_ids(model_dir, 1)[0]
    want = Tokenizer.from_dir(model_dir).decode(plain_outputs(model_dir, [prompt], 16)[0])

    def completion() -> str | None:
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        except httpx.HTTPError:
            return None
        return r.json()["choices"][0]["text"] if r.status_code == 200 else None

    first = Process(["/bin/sh", "-c", script], environ(tmp_path))
    try:
        first.wait_for("gateway serving", 240)
        assert wait_until(lambda: completion() == want, 60), first.output()
        pids = {m["member_id"]: m["pid"] for m in stack.status(namespace=GW_NS)
                if m["role"] != "gateway"}
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        second = Process(["/bin/sh", "-c", script], environ(tmp_path))
        second.wait_for("gateway serving", 120)
        assert "already running" not in second.output()
        assert wait_until(lambda: completion() == want, 60), second.output()
        assert {m["member_id"]: m["pid"] for m in stack.status(namespace=GW_NS)
                if m["role"] != "gateway"} == pids  # the same stack served throughout
        # a controller restart is not the stack going away: the gateway stays and serves
        controller = stack.connect(namespace=GW_NS)
        os.kill(ray.get(controller.ping.remote(), timeout=10)["pid"], signal.SIGKILL)
        assert wait_until(lambda: completion() == want, 60), second.output()
        assert wait_until(lambda: [m for m in _status_or_empty(stack)
                                   if m["role"] == "gateway" and m["state"] == "ready"], 30)
        assert second.proc.poll() is None, second.output()
        second.proc.terminate()
        assert second.proc.wait(60) == 0, second.output()
        assert {m["role"] for m in stack.status(namespace=GW_NS)} >= {"drafter", "verifier"}
    finally:
        for p in (first, locals().get("second")):
            if p is not None and p.proc.poll() is None:
                p.proc.kill()
        stack.down(namespace=GW_NS)


def _status_or_empty(stack) -> list[dict]:
    try:
        return stack.status(namespace=GW_NS)
    except stack.StackError:  # the controller restarting
        return []

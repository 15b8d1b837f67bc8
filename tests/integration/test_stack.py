"""The Ray-hosted stack on the session's local Ray: lossless outputs through verifier and
drafter actors, scaling under load, drafter and verifier crashes, and the stack commands
from another process. Tests run in file order; the last one stops the stack."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from chainspec.cluster import stack
from chainspec.cluster.config import StackConfig
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.integration import helpers
from tests.integration.helpers import (
    LoadGenerator,
    generate,
    plain_outputs,
    prompt_ids,
    verifier_stub,
)

NS = "chainspec-test"
K = 3
MEMBER_KEYS = {"role", "endpoint", "state", "load", "pid", "node", "metrics_url"}


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    def now():
        try:
            return stack.status(namespace=NS)
        except stack.StackNotFound as e:
            return str(e)
    return helpers.wait_for(predicate, timeout, what, now)


def members(role: str, state: str | None = "ready") -> list[dict]:
    return [m for m in stack.status(namespace=NS)
            if m["role"] == role and (state is None or m["state"] == state)]


def routed_verifier(drafters: int = 1):
    """A stub to the ready verifier once it routes to `drafters` drafters."""
    def ready():
        vs = members("verifier")
        if len(vs) != 1:
            return None
        channel, stub = verifier_stub(vs[0]["endpoint"])
        try:
            if stub.Info(pb.VerifierInfoRequest(), timeout=5).drafters == drafters:
                return channel, stub
        except grpc.RpcError:
            pass
        channel.close()
        return None
    return wait_for(ready, what=f"a verifier routed to {drafters} drafter(s)")


@pytest.fixture(scope="module")
def up(ray_cluster, model_dir):
    config = StackConfig(model_dir=str(model_dir), num_steps=K, max_seqs=16, max_len=256,
                         health_interval_s=0.5, health_timeout_s=3.0, drain_timeout_s=20.0,
                         namespace=NS)
    stack.up(config)
    yield config
    try:
        stack.down(namespace=NS)
    except stack.StackNotFound:
        pass  # the CLI test stopped it


@pytest.fixture(scope="module")
def prompts(model_dir):
    return prompt_ids(model_dir, 16)


@pytest.fixture(scope="module")
def plain24(model_dir, prompts):
    return plain_outputs(model_dir, prompts, 24)


@pytest.fixture(scope="module")
def plain200(model_dir, prompts):
    return plain_outputs(model_dir, prompts, 200)


def run_concurrently(stub, prompts, max_tokens, timeout=60.0, started=None):
    results = [None] * len(prompts)

    def work(i):
        try:
            results[i] = generate(stub, prompts[i], max_tokens, timeout=timeout)
        except grpc.RpcError as e:
            results[i] = e
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    if started is not None:
        started()
    for t in threads:
        t.join(timeout=timeout + 10)
    return results


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_through_actors_equals_plain(up, prompts, plain24, batch) -> None:
    channel, stub = routed_verifier()
    got = []
    for i in range(0, 8, batch):
        got += run_concurrently(stub, prompts[i:i + batch], 24)
    channel.close()
    assert [g.tokens for g in got] == plain24[:8]
    assert sum(g.finished.stats.accepted_tokens for g in got) > 0


def test_status_reports_every_member(up) -> None:
    ms = stack.status(namespace=NS)
    assert sorted(m["role"] for m in ms) == ["drafter", "verifier"]
    for m in ms:
        assert MEMBER_KEYS <= set(m) and m["state"] == "ready" and m["pid"] > 0
        assert m["endpoint"].startswith("127.0.0.1:")
        assert m["metrics_url"].startswith("http://127.0.0.1:")  # its own ephemeral port
        assert m["metrics_url"].endswith("/metrics")


def test_scale_drafters_under_load_is_lossless(up, prompts, model_dir) -> None:
    expected = plain_outputs(model_dir, prompts[:8], 64)
    channel, stub = routed_verifier()
    first = members("drafter")[0]["member_id"]
    load = LoadGenerator(stub, prompts[:8], expected, max_tokens=64, workers=6)
    try:
        stack.scale("drafter", 2, namespace=NS)
        wait_for(lambda: [m for m in members("drafter")
                          if m["member_id"] != first and m["load"] > 0],
                 what="the new drafter holding sequences")
        done_at_peak = load.done
        stack.scale("drafter", 1, namespace=NS)  # drains one of the two
        time.sleep(1.0)  # requests keep flowing after the drain
    finally:
        load.stop()
        channel.close()
    assert load.failures == []
    assert load.done > done_at_peak > 0
    assert len(members("drafter", state=None)) == 1


def test_drafter_sigkill_keeps_requests_alive(up, prompts, plain200) -> None:
    channel, stub = routed_verifier()
    victim = members("drafter")[0]
    killed = []

    def kill_when_running():
        wait_for(lambda: stub.Info(pb.VerifierInfoRequest()).running >= 8, 30,
                 "requests running")
        os.kill(victim["pid"], signal.SIGKILL)
        killed.append(time.monotonic())
    results = run_concurrently(stub, prompts, 200, started=kill_when_running)
    channel.close()
    assert killed
    assert [getattr(r, "tokens", r) for r in results] == plain200
    assert any(r.finished.stats.fallback_rounds > 0 for r in results)  # it did hit them
    # Ray restarts the actor, it registers again, the verifier routes to it
    back = wait_for(lambda: [m for m in members("drafter") if m["pid"] != victim["pid"]],
                    what="the drafter restarted")
    assert back[0]["restarts"] >= 1
    channel, stub = routed_verifier()
    later = generate(stub, prompts[0], 24)
    channel.close()
    assert later.tokens == plain200[0][:24]
    assert later.finished.stats.accepted_tokens > 0  # speculative again


def test_verifier_sigkill_fails_fast_then_restarts(up, prompts, plain24) -> None:
    channel, stub = routed_verifier()
    victim = members("verifier")[0]
    t0 = time.monotonic()

    def kill_when_running():
        wait_for(lambda: stub.Info(pb.VerifierInfoRequest()).running >= 4, 30,
                 "requests running")
        os.kill(victim["pid"], signal.SIGKILL)
    results = run_concurrently(stub, [[1, 2, 3]] * 8, 240, timeout=30.0,
                               started=kill_when_running)
    elapsed = time.monotonic() - t0
    channel.close()
    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    assert errors, "the verifier died with no request in flight"
    assert all(e.code() == grpc.StatusCode.UNAVAILABLE for e in errors)
    assert elapsed < 20  # failed at once, not at the 30 s deadline
    wait_for(lambda: [m for m in members("verifier") if m["pid"] != victim["pid"]],
             what="the verifier restarted")
    channel, stub = routed_verifier()
    got = generate(stub, prompts[1], 24)
    channel.close()
    assert got.tokens == plain24[1]


def test_external_gateway_joins_heartbeats_and_expires(up) -> None:
    import ray
    controller = stack.connect(namespace=NS)
    info = {"serving": True, "endpoint": "127.0.0.1:8000", "load": 0, "pid": os.getpid(),
            "node": "127.0.0.1", "error": None, "metrics_url": "http://127.0.0.1:8000/metrics"}
    member_id = ray.get(controller.join.remote("gateway", info))
    gateway = wait_for(lambda: members("gateway"), 10, "the gateway listed")[0]
    assert gateway["metrics_url"] == info["metrics_url"]
    for _ in range(8):  # heartbeats keep it ready past the 3 s health timeout
        assert ray.get(controller.register.remote(member_id, {**info, "load": 2}))
        time.sleep(0.5)
    assert members("gateway")[0]["load"] == 2
    wait_for(lambda: members("gateway", state="dead"), 10, "the silent gateway marked dead")
    ray.get(controller.leave.remote(member_id))
    assert members("gateway", state=None) == []


def test_up_fails_with_the_reason_and_leaves_nothing(ray_cluster, tmp_path) -> None:
    config = StackConfig(model_dir=str(tmp_path / "missing"), namespace="chainspec-bad")
    with pytest.raises(stack.StackError, match="drafter-0=dead .*config.json not found"):
        stack.up(config, timeout_s=60)
    with pytest.raises(stack.StackNotFound):
        stack.status(namespace="chainspec-bad")
    import ray  # members are detached actors: nothing of the failed stack may linger
    wait_for(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True)
                          if a["namespace"] == "chainspec-bad"], 10, "no actor left")


def cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`chainspec ...` in a fresh process (finds the stack through the state file)."""
    return subprocess.run([sys.executable, "-m", "chainspec.cli", *args, "--namespace", NS],
                          capture_output=True, text=True, timeout=timeout, env=os.environ)


def test_cli_status_json_from_another_process(up) -> None:
    r = cli("status", "--json")
    assert r.returncode == 0, r.stderr
    ms = json.loads(r.stdout)["members"]
    assert sorted(m["role"] for m in ms) == ["drafter", "verifier"]
    assert all(MEMBER_KEYS <= set(m) for m in ms)
    assert {m["pid"] for m in ms} == {m["pid"] for m in stack.status(namespace=NS)}
    for m in ms:  # each member's metrics_url serves that process's own metrics
        text = urllib.request.urlopen(m["metrics_url"], timeout=10).read().decode()
        own = "chainspec_drafter_sequences" if m["role"] == "drafter" \
            else "chainspec_num_requests_running"
        assert "chainspec_build_info{" in text and own in text, m["member_id"]


def test_cli_scale_from_another_process(up) -> None:
    r = cli("scale", "drafters", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert len(members("drafter")) == 2
    r = cli("scale", "drafters", "1")
    assert r.returncode == 0, r.stderr
    assert len(members("drafter", state=None)) == 1


def test_cli_down_from_another_process(up) -> None:
    pids = [m["pid"] for m in stack.status(namespace=NS)]
    r = cli("down")
    assert r.returncode == 0, r.stderr
    with pytest.raises(stack.StackNotFound):
        stack.status(namespace=NS)
    wait_for(lambda: not any(_alive(p) for p in pids), 30, "member processes to exit")
    r = cli("status")  # `down` removed the state file: nothing names the stack now
    assert r.returncode == 1 and "no state file" in r.stderr, r.stderr
    import ray
    r = cli("status", "--address", ray.get_runtime_context().gcs_address)
    assert r.returncode == 1 and "no chainspec stack" in r.stderr, r.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

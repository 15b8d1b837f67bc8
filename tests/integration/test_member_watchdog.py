"""On real Ray: a verifier actor whose engine thread dies turns its health NOT_SERVING
within 2 s, `status` shows it dead with the reason, Ray restarts it (a new process) and it
serves exactly again; `status` shows each verifier's drafter links."""

from __future__ import annotations

import time

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chainspec.cluster import stack
from chainspec.cluster.config import StackConfig
from chainspec.rpc.verifier_service import VERIFIER_SERVICE
from tests.integration.helpers import (
    generate,
    plain_outputs,
    prompt_ids,
    verifier_stub,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)
NS = "chainspec-watchdog-test"


@pytest.fixture(scope="module")
def up(ray_cluster, model_dir):
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=8, max_len=256,
                         health_interval_s=0.5, health_timeout_s=3.0, namespace=NS)
    stack.up(config)
    yield config
    stack.down(namespace=NS)


def _verifier() -> dict | None:
    ready = [m for m in stack.status(namespace=NS) if m["role"] == "verifier"]
    return ready[0] if ready else None


def _wait(predicate, timeout: float, what: str):
    return wait_for(predicate, timeout, what, lambda: stack.status(namespace=NS))


def _not_serving(endpoint: str) -> bool:
    channel = grpc.insecure_channel(endpoint)
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE), timeout=1).status
        return status != health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return True  # the process is already gone: not serving either
    finally:
        channel.close()


def _break_engine(actor) -> None:
    def inject(self) -> None:
        def broken_step():
            raise RuntimeError("injected engine fault")
        self.server.engine.engine.step = broken_step
    ray.get(actor.__ray_call__.remote(inject))


def test_status_shows_each_verifiers_drafter_links(up) -> None:
    drafter = _wait(lambda: [m for m in stack.status(namespace=NS)
                             if m["role"] == "drafter" and m["state"] == "ready"], 60, "drafter")
    links = _wait(lambda: (_verifier() or {}).get("links"), 60, "links")
    assert links == {drafter[0]["endpoint"]: "live"}


def test_a_dead_engine_is_not_serving_at_once_and_the_member_comes_back(up, model_dir) -> None:
    prompt = prompt_ids(model_dir, 1)[0]
    plain = plain_outputs(model_dir, [prompt], max_tokens=16)[0]
    before = _wait(lambda: (v := _verifier()) and v["state"] == "ready" and v, 60, "verifier")
    actor = ray.get_actor(f"chainspec-{before['member_id']}", namespace=NS)
    _break_engine(actor)
    channel, stub = verifier_stub(before["endpoint"])
    try:
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, prompt, max_tokens=16, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        t0 = time.monotonic()
        _wait(lambda: _not_serving(before["endpoint"]), 2.0, "NOT_SERVING")
        print(f"NOT_SERVING after {time.monotonic() - t0:.2f} s")
    finally:
        channel.close()
    dead = _wait(lambda: (v := _verifier()) and v["state"] == "dead" and v, 10, "dead member")
    assert "injected engine fault" in dead["error"]
    back = _wait(lambda: (v := _verifier()) and v["state"] == "ready" and v["pid"] !=
                 before["pid"] and v, 120, "restarted verifier")
    assert back["member_id"] == before["member_id"] and back["restarts"] >= 1
    channel, stub = verifier_stub(back["endpoint"])
    try:
        assert generate(stub, prompt, max_tokens=16).tokens == plain
    finally:
        channel.close()

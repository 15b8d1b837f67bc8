"""A seed means the same output (issue 19, DESIGN 3.3): 32 seeded requests at temperature
0.8 through the Ray-hosted stack give the same tokens run one by one, all at once, with
the drafter SIGKILLed mid-run, and with drafters scaled to 0. Tests run in file order."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from chainspec.cluster import stack
from chainspec.cluster.config import StackConfig
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.integration import helpers
from tests.integration.helpers import generate, prompt_ids, verifier_stub

NS = "chainspec-test-seeds"
N, MAX_TOKENS = 32, 12


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    return helpers.wait_for(predicate, timeout, what, lambda: stack.status(namespace=NS))


def members(role: str) -> list[dict]:
    return [m for m in stack.status(namespace=NS) if m["role"] == role and m["state"] == "ready"]


def routed_verifier(drafters: int):
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
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=N, max_len=256,
                         health_interval_s=0.5, health_timeout_s=3.0, drain_timeout_s=20.0,
                         namespace=NS)
    stack.up(config)
    yield config
    stack.down(namespace=NS)


@pytest.fixture(scope="module")
def prompts(model_dir):
    return prompt_ids(model_dir, N)


def seeded(stub, prompt, i: int):
    return generate(stub, prompt, MAX_TOKENS, timeout=120.0,
                    sampling=pb.SamplingParams(temperature=0.8, seed=1000 + i))


def at_once(stub, prompts, started=None) -> list:
    results = [None] * len(prompts)

    def work(i):
        results[i] = seeded(stub, prompts[i], i)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    if started is not None:
        started()
    for t in threads:
        t.join(timeout=180)
    return results


@pytest.fixture(scope="module")
def alone(up, prompts):
    channel, stub = routed_verifier(1)
    results = [seeded(stub, p, i) for i, p in enumerate(prompts)]
    channel.close()
    return results


def test_alone_then_at_once(alone, prompts) -> None:
    channel, stub = routed_verifier(1)
    together = at_once(stub, prompts)
    channel.close()
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert len({tuple(r.tokens) for r in alone}) > N // 2  # sampled, not one text
    assert sum(r.finished.stats.accepted_tokens for r in alone + together) > 0


def test_drafter_sigkill_mid_run(alone, prompts) -> None:
    channel, stub = routed_verifier(1)
    victim = members("drafter")[0]
    killed = []

    def kill_when_running():
        wait_for(lambda: stub.Info(pb.VerifierInfoRequest()).running >= 8, 30,
                 "requests running")
        os.kill(victim["pid"], signal.SIGKILL)
        killed.append(time.monotonic())
    results = at_once(stub, prompts, started=kill_when_running)
    channel.close()
    assert killed
    assert [r.tokens for r in results] == [r.tokens for r in alone]
    assert any(r.finished.stats.fallback_rounds > 0 for r in results)  # the kill was felt
    wait_for(lambda: [m for m in members("drafter") if m["pid"] != victim["pid"]],
             what="the drafter restarted")


def test_drafters_scaled_to_zero(alone, prompts) -> None:
    stack.scale("drafter", 0, namespace=NS)
    channel, stub = routed_verifier(0)
    results = at_once(stub, prompts)
    channel.close()
    assert [r.tokens for r in results] == [r.tokens for r in alone]
    assert all(r.finished.stats.draft_tokens == 0 for r in results)  # plain decoding

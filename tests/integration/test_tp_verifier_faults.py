"""A verifier member that is a TP=2 group on real Ray (issue 22 must-show, faults): the
ranks are two actors in one placement group (rank 1 owned by rank 0), `status` shows
both with pid, node and state, and the intent records the group's size. SIGKILL rank 1
under 16 streams: no stream hangs -- each completes equal to plain decoding or ends
UNAVAILABLE within the collective timeout (this stack's only verifier is gone) -- the
member turns dead, the group restarts as a unit (both ranks new processes) and serves
16 streams equal to plain again."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from ray.util.placement_group import placement_group_table

from chainspec.cluster import stack
from chainspec.cluster.config import DrafterRoleConfig, RoleConfig, StackConfig
from chainspec.cluster.intent import IntentStore, group_name
from tests.integration.helpers import generate, plain_outputs, prompt_ids, verifier_stub, wait_for

pytestmark = pytest.mark.timeout(180)
NS = "chainspec-tp-faults-test"
STREAMS, TOKENS = 16, 160
COLLECTIVE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def up(ray_cluster, model_dir):
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=STREAMS,
                         max_len=256, health_interval_s=0.5, health_timeout_s=3.0,
                         namespace=NS, drafter=DrafterRoleConfig(mode="local", replicas=0),
                         verifier=RoleConfig(tensor_parallel_size=2,
                                             collective_timeout_s=COLLECTIVE_TIMEOUT_S))
    stack.up(config)
    yield config
    stack.down(namespace=NS)


def _verifier() -> dict:
    return next(m for m in stack.status(namespace=NS) if m["role"] == "verifier")


def _ready_group(pids_not: set[int] = frozenset()) -> dict:
    def ready():
        v = _verifier()
        ranks = v.get("ranks") or []
        ok = v["state"] == "ready" and len(ranks) == 2 and \
            all(r["state"] == "alive" and r["pid"] not in pids_not for r in ranks)
        return v if ok else None
    return wait_for(ready, 120, "a ready TP=2 verifier", lambda: stack.status(namespace=NS))


def _streams(endpoint: str, prompts, timeout: float) -> list[tuple[object, float]]:
    """Each prompt on its own thread; (tokens or the RpcError, seconds it took)."""
    channel, stub = verifier_stub(endpoint)
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        t0 = time.monotonic()
        try:
            got: object = generate(stub, prompts[i], TOKENS, timeout=timeout).tokens
        except grpc.RpcError as e:
            got = e
        results[i] = (got, time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return results, threads, channel


def test_a_killed_rank_fails_fast_and_the_group_restarts_as_a_unit(up, model_dir) -> None:
    prompts = prompt_ids(model_dir, STREAMS)
    plain = plain_outputs(model_dir, prompts, max_tokens=TOKENS)
    before = _ready_group()
    ranks = {r["rank"]: r for r in before["ranks"]}
    assert sorted(ranks) == [0, 1] and ranks[0]["pid"] == before["pid"]
    assert ranks[0]["pid"] != ranks[1]["pid"] and ranks[0]["node"] == ranks[1]["node"]
    assert IntentStore(NS).load().group_sizes == {before["member_id"]: 2}
    pg = next(p for p in placement_group_table().values()
              if p["name"] == group_name(before["member_id"]))
    assert pg["strategy"] == "STRICT_PACK" and len(pg["bundles"]) == 2

    results, threads, channel = _streams(before["endpoint"], prompts, timeout=60)
    time.sleep(0.5)  # the streams are running (160 tokens each take seconds at TP=2)
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(60)
    channel.close()
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    failed = 0
    for i, (got, _) in enumerate(results):
        if isinstance(got, grpc.RpcError):  # a clear error, within the collective timeout
            assert got.code() is grpc.StatusCode.UNAVAILABLE, (i, got.code(), got.details())
            failed += 1
        else:
            assert got == plain[i], f"stream {i} completed but differs from plain"
    assert time.monotonic() - killed < COLLECTIVE_TIMEOUT_S + 10
    assert failed > 0  # the kill landed while streams were running
    print(f"{failed}/{STREAMS} streams ended UNAVAILABLE, "
          f"{STREAMS - failed} completed equal to plain")

    back = _ready_group(pids_not={r["pid"] for r in before["ranks"]})
    assert back["member_id"] == before["member_id"] and back["restarts"] >= 1
    results, threads, channel = _streams(back["endpoint"], prompts, timeout=60)
    for t in threads:
        t.join(90)
    channel.close()
    assert [got for got, _ in results] == plain

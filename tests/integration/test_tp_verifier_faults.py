"""A verifier member that is a TP=2 group on real Ray (issue 22 must-show, faults): the
ranks are two actors in one placement group (rank 1 owned by rank 0), `status` shows
both with pid, node and state, and the intent records the group's size. SIGKILL rank 1
under 16 streams: no stream hangs -- each completes equal to plain decoding or ends
UNAVAILABLE within the collective timeout (this stack's only verifier is gone) -- the
member turns dead, the group restarts as a unit (both ranks new processes) and serves
16 streams equal to plain again. Through the gateway with two TP=2 verifiers, the
streams on the killed one resume mid-stream on the other (gateway/failover.py): every
stream and every request sent after the kill completes equal to plain."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from ray.util.placement_group import placement_group_table

from chainspec.cluster import stack
from chainspec.cluster.config import DrafterRoleConfig, RoleConfig, StackConfig
from chainspec.cluster.intent import IntentStore, group_name
from tests.integration.helpers import (
    generate,
    plain_outputs,
    prompt_ids,
    ready_tp_verifier,
    verifier_stub,
    wait_for,
)

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
    before = ready_tp_verifier(NS)
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

    back = ready_tp_verifier(NS, pids_not={r["pid"] for r in before["ranks"]})
    assert back["member_id"] == before["member_id"] and back["restarts"] >= 1
    results, threads, channel = _streams(back["endpoint"], prompts, timeout=60)
    for t in threads:
        t.join(90)
    channel.close()
    assert [got for got, _ in results] == plain


def test_through_the_gateway_requests_fail_over_to_the_other_tp_verifier(ray_cluster, model_dir,
                                                                        tmp_path) -> None:
    """`chainspec serve` with two TP=2 verifiers: SIGKILL rank 1 of one under 16 streams.
    The streams on it resume on the other verifier: all 16 complete (none ends with an
    error, none hangs) equal to plain, and the gateway counts the resumes; 16 requests
    sent right after the kill all complete on the other verifier, and the killed group
    comes back with new ranks."""
    import openai

    from chainspec.models.tokenizer import Tokenizer
    from tests.integration import helpers

    ns = "chainspec-tp-failover-test"
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(f"verifier: {{replicas: 2, tensor_parallel_size: 2, "
                   f"collective_timeout_s: {COLLECTIVE_TIMEOUT_S}}}\n"
                   "drafter: {mode: local, replicas: 0}\n"
                   "health_interval_s: 0.5\nhealth_timeout_s: 3.0\n")
    tok = Tokenizer.from_dir(model_dir)
    ids = prompt_ids(model_dir, STREAMS)
    texts = [tok.decode(i) for i in ids]
    plain = [tok.decode(t) for t in plain_outputs(model_dir, ids, TOKENS)]
    served = helpers.start_serve(model_dir, ns, "--config", str(cfg), "--max-seqs",
                                 str(STREAMS))
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    results: list = [None] * STREAMS

    def stream(i: int) -> None:
        t0, text = time.monotonic(), ""
        try:
            for chunk in client.completions.create(
                    model=openai.NOT_GIVEN, prompt=texts[i], max_tokens=TOKENS,
                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text if chunk.choices else ""
            results[i] = (text, time.monotonic() - t0)
        except openai.APIError as e:
            results[i] = (e, time.monotonic() - t0)

    def complete(i: int) -> str:
        return client.completions.create(model=openai.NOT_GIVEN, prompt=texts[i],
                                         max_tokens=TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    try:
        victim = wait_for(lambda: next((m for m in stack.status(namespace=ns)
                                        if m["member_id"] == "verifier-0"
                                        and m["state"] == "ready"
                                        and len(m.get("ranks") or []) == 2), None),
                          60, "verifier-0 with its two ranks")
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        os.kill(victim["ranks"][1]["pid"], signal.SIGKILL)
        with ThreadPoolExecutor(STREAMS) as pool:  # routed to verifier-1 meanwhile
            after = list(pool.map(complete, range(STREAMS)))
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a stream hangs"
        resumes = _metric(served.url, "chainspec_gateway_stream_resumes_total")
        back = wait_for(lambda: next((m for m in stack.status(namespace=ns)
                                      if m["member_id"] == "verifier-0"
                                      and m["state"] == "ready" and m["pid"] != victim["pid"]
                                      and all(r["state"] == "alive" for r in m["ranks"])),
                                     None), 120, "verifier-0 back")
    finally:
        helpers.stop_serve(served, ns)
    failed = {i: got for i, (got, _) in enumerate(results) if isinstance(got, Exception)}
    assert not failed, failed  # the streams on the killed verifier resumed
    assert [got for got, _ in results] == plain
    assert resumes > 0  # the kill landed while streams were running on verifier-0
    assert after == plain  # every request sent after the kill completed on verifier-1
    assert {r["pid"] for r in back["ranks"]}.isdisjoint(r["pid"] for r in victim["ranks"])
    print(f"{resumes:g}/{STREAMS} streams resumed on the other verifier, all equal to "
          f"plain; {STREAMS} requests after the kill completed on the other verifier")


def _metric(url: str, name: str) -> float:
    import httpx
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not exported")

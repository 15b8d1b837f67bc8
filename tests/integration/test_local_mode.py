"""Drafter mode local and pipelined groups on the session's Ray.

`chainspec serve --drafter-mode local --pipeline-groups 2` (a real process joined to the
session's Ray): the verifier actor drafts in its own process, so there is no drafter
actor, yet output equals plain greedy decoding and drafts are accepted; status shows the
mode, and scaling drafters is refused with the reason. A remote stack with
`pipeline_groups: 2`: the setting reaches the verifier's engine and output stays equal
to plain. Tests run in file order."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import ray

from chainspec.cluster import stack
from chainspec.cluster.config import StackConfig
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.integration.helpers import (
    cli,
    generate,
    plain_outputs,
    prompt_ids,
    start_serve,
    stop_serve,
    verifier_stub,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)
NS_LOCAL = "chainspec-local-mode-test"
NS_GROUPS = "chainspec-groups-test"
TOKENS = 32
LONG = 96  # tokens per stream in the SIGKILL test: the kill lands mid-run


@pytest.fixture(scope="module")
def served(ray_cluster, model_dir):
    s = start_serve(model_dir, NS_LOCAL, "--max-seqs", "8", "--drafter-mode", "local",
                    "--pipeline-groups", "2")
    yield s
    stop_serve(s, NS_LOCAL, 60)


@pytest.fixture(scope="module")
def remote_groups(ray_cluster, model_dir):
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=8, max_len=256,
                         health_interval_s=0.5, namespace=NS_GROUPS, pipeline_groups=2)
    stack.up(config)
    yield config
    stack.down(namespace=NS_GROUPS)


@pytest.fixture(scope="module")
def prompts(model_dir):
    return prompt_ids(model_dir, 8)


@pytest.fixture(scope="module")
def plain(model_dir, prompts):
    return plain_outputs(model_dir, prompts, TOKENS)


def verifier(ns: str) -> dict:
    [v] = [m for m in stack.status(namespace=ns) if m["role"] == "verifier"]
    return v


def engine_groups(ns: str, member_id: str) -> int:
    """The pipelined groups of the verifier actor's own engine (read inside the actor)."""
    actor = ray.get_actor(f"chainspec-{member_id}", namespace=ns)
    return ray.get(actor.__ray_call__.remote(
        lambda self: self.server.engine.engine.config.groups), timeout=30)


def concurrently(endpoint: str, prompts) -> list:
    channel, stub = verifier_stub(endpoint)
    results: list = [None] * len(prompts)

    def work(i: int) -> None:
        results[i] = generate(stub, prompts[i], TOKENS)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    channel.close()
    return results


def test_serve_says_it_drafts_in_process(served) -> None:
    assert "each drafting in process (drafter mode local, speculative decoding on)" \
        in served.output(), served.output()


@pytest.mark.parametrize("batch", [1, 8])
def test_local_mode_equals_plain_and_speculates(served, prompts, plain, batch) -> None:
    v = verifier(NS_LOCAL)
    got = []
    for i in range(0, 8, batch):
        got += concurrently(v["endpoint"], prompts[i:i + batch])
    assert [g.tokens for g in got] == plain  # lossless: the verifier decides every token
    assert sum(g.finished.stats.accepted_tokens for g in got) > 0  # drafts were used
    assert all(g.finished.stats.fallback_rounds == 0 for g in got)  # no wire to be late
    channel, stub = verifier_stub(v["endpoint"])
    assert stub.Info(pb.VerifierInfoRequest(), timeout=10).drafters == 1  # in process
    channel.close()


def test_local_mode_has_no_drafter_and_status_shows_the_mode(served) -> None:
    done = cli(NS_LOCAL, "status", "--json")
    assert done.returncode == 0, done.stderr
    members = json.loads(done.stdout)["members"]
    assert sorted(m["role"] for m in members) == ["gateway", "verifier"]  # no drafter
    [v] = [m for m in members if m["role"] == "verifier"]
    assert v["drafter_mode"] == "local" and v["links"] == {"in-process": "live"}
    assert engine_groups(NS_LOCAL, v["member_id"]) == 2  # --pipeline-groups reached it
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == NS_LOCAL and "drafter" in a["name"]]


def test_scaling_drafters_is_refused_in_local_mode(served) -> None:
    done = cli(NS_LOCAL, "scale", "drafters", "1")
    assert done.returncode == 1
    assert "drafter mode is local" in done.stderr and "Traceback" not in done.stderr
    assert [m["role"] for m in stack.status(namespace=NS_LOCAL)
            if m["role"] == "drafter"] == []


def test_remote_pipeline_groups_reach_the_engine_and_stay_lossless(remote_groups, prompts,
                                                                   plain) -> None:
    v = verifier(NS_GROUPS)
    assert v["drafter_mode"] == "remote"
    assert engine_groups(NS_GROUPS, v["member_id"]) == 2

    def connected():
        channel, stub = verifier_stub(v["endpoint"])
        try:
            return stub.Info(pb.VerifierInfoRequest(), timeout=10).drafters == 1
        finally:
            channel.close()
    wait_for(connected, 60, "the verifier connected to its drafter")
    got = concurrently(v["endpoint"], prompts)
    assert [g.tokens for g in got] == plain
    assert sum(g.finished.stats.accepted_tokens for g in got) > 0


def test_drafter_sigkill_during_pipelined_rounds_loses_nothing(remote_groups, model_dir
                                                               ) -> None:
    """16 concurrent streams through a verifier running two pipelined groups; its only
    drafter is SIGKILLed mid-run: every stream finishes with plain's output, and once Ray
    has restarted the drafter the verifier speculates again."""
    many = prompt_ids(model_dir, 16)
    want = plain_outputs(model_dir, many, LONG)
    v = verifier(NS_GROUPS)
    [victim] = [m for m in stack.status(namespace=NS_GROUPS) if m["role"] == "drafter"]
    channel, stub = verifier_stub(v["endpoint"])
    results: list = [None] * len(many)

    def work(i: int) -> None:
        try:
            results[i] = generate(stub, many[i], LONG)
        except Exception as e:  # reported by the equality check below
            results[i] = e
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(many))]
    for t in threads:
        t.start()
    wait_for(lambda: stub.Info(pb.VerifierInfoRequest()).running >= 8, 60, "8 running")
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(180)
    channel.close()
    assert [getattr(r, "tokens", r) for r in results] == want
    assert any(r.finished.stats.fallback_rounds > 0 for r in results)  # the kill hit them
    back = wait_for(lambda: [m for m in stack.status(namespace=NS_GROUPS)
                             if m["role"] == "drafter" and m["state"] == "ready"
                             and m["pid"] != victim["pid"]], 120, "the drafter restarted")
    assert back
    wait_for(lambda: concurrently(v["endpoint"], many[:2])[0].finished.stats.accepted_tokens
             > 0, 60, "speculation back after the restart")

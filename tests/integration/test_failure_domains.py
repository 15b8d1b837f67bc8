"""Failure domains (DESIGN 4.4): the controller is off the data path and does not own its
members' lives. A SIGKILLed controller loses no request in flight (outputs stay plain
greedy's), its members keep running (same processes), verifiers keep their drafter
links, and the restarted controller comes back with the scaled counts and the same
members; `down` still leaves no actor behind. Tests run in file order on one stack."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import ray

from chainspec.cluster import stack
from chainspec.cluster.config import StackConfig
from chainspec.cluster.intent import IntentStore
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.integration.helpers import (
    generate,
    plain_outputs,
    prompt_ids,
    verifier_stub,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)
NS = "chainspec-failure-domains"
STREAMS, TOKENS = 32, 48
RECOVERY_S = 30.0  # bound on a controller's restart + re-adoption


def controller():
    return stack.connect(namespace=NS)


def controller_pid() -> int | None:
    try:
        return ray.get(controller().ping.remote(), timeout=2)["pid"]
    except Exception:  # restarting
        return None


def kill_controller() -> tuple[int, float]:
    """SIGKILL the controller's process; (its pid, when)."""
    pid = controller_pid()
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


def members_by_id() -> dict[str, dict]:
    return {m["member_id"]: m for m in stack.status(namespace=NS)}


def ready_after_restart(old_pid: int) -> dict[str, dict]:
    """Members once a new controller process answers with none of them starting."""
    def back():
        pid = controller_pid()
        if pid is None or pid == old_pid:
            return None
        ms = members_by_id()
        return ms if all(m["state"] == "ready" for m in ms.values()) else None
    return wait_for(back, RECOVERY_S, "the restarted controller with every member ready")


@pytest.fixture(scope="module")
def up(ray_cluster, model_dir):
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=STREAMS,
                         max_len=256, health_interval_s=0.5, health_timeout_s=3.0,
                         drain_timeout_s=20.0, namespace=NS)
    stack.up(config)
    yield config
    try:
        stack.down(namespace=NS)
    except stack.StackNotFound:
        pass  # the last test stopped it


@pytest.fixture(scope="module")
def prompts(model_dir):
    return prompt_ids(model_dir, STREAMS)


@pytest.fixture(scope="module")
def plain(model_dir, prompts):
    return plain_outputs(model_dir, prompts, TOKENS)


def test_controller_sigkill_loses_no_request_and_no_member(up, prompts, plain) -> None:
    """32 streams keep going from before the kill until the new controller has
    re-adopted every member: every one of them completes with plain greedy's tokens."""
    before = members_by_id()
    verifier = next(m for m in before.values() if m["role"] == "verifier")
    channel, stub = verifier_stub(verifier["endpoint"])
    done: list = []  # Generated, or the RpcError that lost a request
    links: list[int] = []  # drafters the verifier routes to, sampled meanwhile
    stop = threading.Event()

    def work(i):
        while not stop.is_set():
            try:
                done.append((i, generate(stub, prompts[i], TOKENS, timeout=120)))
            except grpc.RpcError as e:
                done.append((i, e))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: stub.Info(pb.VerifierInfoRequest()).running >= 8, 60,
                 "requests running")
        old_pid, t0 = kill_controller()
        sampler = threading.Thread(target=sample_links, args=(stub, links, stop))
        sampler.start()
        after = ready_after_restart(old_pid)
        print(f"controller back, members ready, in {time.monotonic() - t0:.1f} s; "
              f"{len(done)} requests done so far")
        time.sleep(0.5)  # and a little beyond
    finally:
        stop.set()
        for t in threads:
            t.join(130)
    sampler.join(10)
    channel.close()
    assert len(done) > STREAMS  # requests spanned the controller's downtime
    assert [getattr(r, "tokens", r) for _, r in done] == [plain[i] for i, _ in done]
    assert sum(r.finished.stats.accepted_tokens for _, r in done) > 0
    assert links and min(links) == 1, "the verifier dropped its drafter link"
    assert {k: m["pid"] for k, m in after.items()} == {k: m["pid"] for k, m in before.items()}


def sample_links(stub, links: list[int], stop: threading.Event) -> None:
    while not stop.is_set():
        links.append(stub.Info(pb.VerifierInfoRequest()).drafters)
        time.sleep(0.05)


def test_restarted_controller_keeps_scaled_count_and_members(up, prompts, plain) -> None:
    stack.scale("drafter", 2, namespace=NS)
    drafters = sorted(k for k, m in members_by_id().items() if m["role"] == "drafter")
    assert len(drafters) == 2
    old_pid, t0 = kill_controller()
    after = ready_after_restart(old_pid)
    took = time.monotonic() - t0
    assert sorted(k for k, m in after.items() if m["role"] == "drafter") == drafters, after
    print(f"controller back with {len(drafters)} drafters ready in {took:.1f} s")
    verifier = next(m for m in after.values() if m["role"] == "verifier")
    channel, stub = verifier_stub(verifier["endpoint"])
    got = generate(stub, prompts[0], TOKENS)
    channel.close()
    assert got.tokens == plain[0] and got.finished.stats.accepted_tokens > 0


def test_restarted_controller_finishes_a_drain_it_had_begun(up, prompts, plain) -> None:
    """A controller dies mid scale-down: its intent says 1 drafter and drafter X
    draining; the restarted controller drains X (and only X) to the end."""
    drafters = {k: m for k, m in members_by_id().items() if m["role"] == "drafter"}
    assert len(drafters) == 2
    victim = max(drafters)
    pid = controller_pid()
    os.kill(pid, signal.SIGSTOP)  # frozen: it writes nothing while we edit its intent
    try:
        store = IntentStore(NS)
        intent = store.load()
        intent.replicas["drafter"], intent.draining = 1, [victim]
        store.save(intent)
    finally:
        os.kill(pid, signal.SIGKILL)
    def drained():
        try:
            ms = members_by_id()
        except stack.StackError:  # the controller restarting
            return False
        return sorted(k for k, m in ms.items() if m["role"] == "drafter") == \
            sorted(set(drafters) - {victim})
    wait_for(drained, RECOVERY_S + 30, f"{victim} drained and gone")
    wait_for(lambda: not _alive(drafters[victim]["pid"]), 30, "the drained drafter's exit")
    assert IntentStore(NS).load().draining == []
    verifier = next(m for m in members_by_id().values() if m["role"] == "verifier")
    channel, stub = verifier_stub(verifier["endpoint"])
    got = generate(stub, prompts[2], TOKENS)
    channel.close()
    assert got.tokens == plain[2]


def test_members_outlive_a_controller_killed_for_good_and_down_kills_them(
        up, prompts, plain) -> None:
    before = members_by_id()
    ray.kill(controller(), no_restart=True)
    time.sleep(1.0)
    verifier = next(m for m in before.values() if m["role"] == "verifier")
    channel, stub = verifier_stub(verifier["endpoint"])
    got = generate(stub, prompts[1], TOKENS)  # still serving, still speculative
    channel.close()
    assert got.tokens == plain[1] and got.finished.stats.accepted_tokens > 0
    stack.down(namespace=NS)  # no controller: the members its intent lists are killed
    assert_no_actor_left([m["pid"] for m in before.values()])


def test_down_leaves_no_actor_even_before_readoption(up) -> None:
    """`down` right after a controller kill: members not yet re-adopted die too."""
    stack.up(up)
    pids = [m["pid"] for m in members_by_id().values()]
    kill_controller()
    stack.down(namespace=NS)
    assert_no_actor_left(pids)


def assert_no_actor_left(pids: list[int]) -> None:
    wait_for(lambda: not [a for a in ray.util.list_named_actors(all_namespaces=True)
                          if a["namespace"] == NS], 10, "no named actor left in the namespace")
    wait_for(lambda: not any(_alive(p) for p in pids), 30, "member processes to exit")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

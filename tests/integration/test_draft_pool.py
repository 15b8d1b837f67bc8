"""A verifier engine drafting through `GrpcDraftClient` against real drafter servers:
lossless and exactly as fast (same drafts) as the in-process drafter, sticky
least-loaded assignment, and a drafter killed, drained, added or removed mid-run."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from chainspec.engine import verifier as verifier_module
from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.draft_types import ErrorCode, SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.request import FinishReason, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.rpc.draft_pool import DrafterMatch, GrpcDraftClient, LinkState
from tests.integration.grpc_helpers import drafter_engine, start_drafter, wait_until
from tests.unit.engine_fixtures import RandomDepth, engine, outputs, prompts

pytestmark = pytest.mark.timeout(120)
K, MAX_TOKENS = 3, 24
PATIENT = 10.0  # a round deadline no healthy loopback round misses: drafts equal local


@pytest.fixture(scope="module")
def batch(models):
    return prompts(8, vocab=models[0].config.vocab_size, seed=11)


@pytest.fixture(scope="module")
def plain(models, batch):
    return outputs(engine(models[0]), batch, MAX_TOKENS)[0]


@pytest.fixture
def drafters(loop, models):
    """start(n) -> n fresh drafter servers (each with its own engine and model copy)."""
    started = []

    def start(n: int, **opts):
        for _ in range(n):
            eng = drafter_engine(copy.deepcopy(models[1]), k=K)
            srv = start_drafter(loop, eng, **opts)
            srv.engine = eng
            started.append(srv)
        return started[-n:]

    yield start
    for srv in started:
        loop.run(srv.stop(0))


def _run(target, client, ps, batch_size: int, draft_ahead: bool = False,
         depth_seed: int | None = None):
    """`depth_seed`: a RandomDepth policy (random verified depths and drafter asks)."""
    got, stats = [], []
    eng = engine(target, client=client, k=K, draft_ahead=draft_ahead)
    if depth_seed is not None:
        eng.depth = RandomDepth(depth_seed, K)
    for i in range(0, len(ps), batch_size):
        out, result = outputs(eng, ps[i:i + batch_size], MAX_TOKENS)
        got += out
        stats += [(c.stats.rounds, c.stats.accepted_tokens, c.stats.accepted_per_pos)
                  for c in result.completions]
    return got, stats, eng


class Driver:
    """Steps a verifier engine by hand, collecting tokens and finish reasons."""

    def __init__(self, eng, max_tokens: int = MAX_TOKENS) -> None:
        self.eng, self.max_tokens, self.tokens, self.finished = eng, max_tokens, {}, {}

    def add(self, ps, tag: str) -> list[str]:
        ids = [f"{tag}{i}" for i in range(len(ps))]
        for rid, p in zip(ids, ps, strict=True):
            self.eng.add_request(rid, p, SamplingParams(temperature=0.0),
                                 StopConditions(max_tokens=self.max_tokens))
            self.tokens[rid] = []
        return ids

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for out in self.eng.step():
                self.tokens[out.request_id] += out.new_tokens
                if out.finished:
                    self.finished[out.request_id] = out.finish_reason

    def step_until(self, condition, limit: int = 200) -> None:
        for _ in range(limit):
            if condition():
                return
            self.step()
        raise AssertionError("condition not reached")

    def finish(self) -> None:
        self.step_until(lambda: not self.eng.has_work)
        assert set(self.finished.values()) == {FinishReason.LENGTH}


@pytest.mark.parametrize("batch_size,num_drafters,depth_seed",
                         [(1, 1, None), (8, 1, None), (1, 2, None), (8, 2, None),
                          (8, 1, 5), (8, 2, 6)])
def test_equals_plain_and_the_in_process_drafter(models, batch, plain, drafters,
                                                 num_drafters, batch_size,
                                                 depth_seed) -> None:
    """`depth_seed`: random verified depths and drafter-side depths (4.11), the same
    choices on both sides, so the remote drafter's rounds of 1..K steps must give the
    in-process drafter's drafts."""
    target, draft = models
    ps = batch if batch_size > 1 else batch[:3]
    local = LocalDraftClient(drafter_engine(copy.deepcopy(draft), k=K))
    want, want_stats, local_eng = _run(target, local, ps, batch_size, depth_seed=depth_seed)
    servers = drafters(num_drafters)
    client = GrpcDraftClient([s.address for s in servers], round_deadline_s=PATIENT,
                             match=DrafterMatch(K, 32, target.config.vocab_size))
    try:
        got, stats, eng = _run(target, client, ps, batch_size, depth_seed=depth_seed)
    finally:
        client.close()
    if depth_seed is not None:
        assert set(eng.depth.rounds) == {1, 2, 3} and eng.depth.rounds == local_eng.depth.rounds
    assert got == want == plain[:len(ps)]
    assert stats == want_stats, "the same drafts as the in-process drafter, round by round"
    assert sum(s[1] for s in stats) > 0
    assert client.stats.bytes_sent > 0 and client.stats.bytes_received > 0
    assert client.stats.late_batches == client.stats.local_failures == 0
    assert wait_until(lambda: all(s.engine.load == 0 for s in servers)), "released"


def test_prefix_cache_hits_reach_a_remote_drafter(models, drafters) -> None:
    """Prompts sharing a prefix (prefix caching on, the default): the update that opens a
    sequence past 0 is routed like a start = 0 one, the drafter reads its MTP KV from its
    cache (no resync), and output and drafts equal the in-process drafter's."""
    target, draft = models
    shared = [(7 * i) % target.config.vocab_size for i in range(1, 50)]  # 3 full blocks
    ps = [shared + p for p in prompts(4, vocab=target.config.vocab_size, seed=4)]
    local = LocalDraftClient(drafter_engine(copy.deepcopy(draft), k=K))
    want, want_stats, _ = _run(target, local, ps, 1)
    (server,) = drafters(1)
    client = GrpcDraftClient([server.address], round_deadline_s=PATIENT,
                             match=DrafterMatch(K, 32, target.config.vocab_size))
    try:
        got, stats, eng = _run(target, client, ps, 1)
    finally:
        client.close()
    assert got == want and stats == want_stats
    assert eng.allocator.cache.hits > 0 and eng.resyncs == 0
    hits = server.engine.allocator.cache.hits
    assert hits == server.engine.allocator.cache.queries > 0
    assert client.stats.local_failures == 0


def test_draft_ahead_over_grpc_equals_plain(models, batch, plain, drafters) -> None:
    """Two drafters, each timing its look-aheads to the verifier's step (on these tiny
    models a step is shorter than a look-ahead, so most are skipped: the clock's
    business); output stays plain. The hit path over the wire is the next test's."""
    target, _ = models
    servers = drafters(2)
    client = GrpcDraftClient([s.address for s in servers], round_deadline_s=PATIENT)
    try:
        got, _, eng = _run(target, client, batch, 8, draft_ahead=True)
    finally:
        client.close()
    assert got == plain
    assert client.stats.local_failures == 0


def test_every_hypothesis_crosses_the_wire_and_output_stays_plain(models, batch, plain,
                                                                   loop, monkeypatch) -> None:
    """Multi-hypothesis look-ahead over gRPC: each answer carries many entries per
    sequence (all accept lengths x top-2 guesses, full K drafts), the verifier keeps them
    all and takes the matching one; output stays plain. The verifier's forward is made
    as slow as a real one (20 ms), so look-aheads arrive before its verdicts."""
    target, draft = models
    run_verify = verifier_module.run_verify

    def slow(*args, **kw):
        time.sleep(0.02)
        return run_verify(*args, **kw)
    monkeypatch.setattr(verifier_module, "run_verify", slow)
    eng = DrafterEngine(copy.deepcopy(draft), DrafterConfig(
        num_steps=K, max_seqs=8, max_len=256, ahead_second_round=True, ahead_rows=10_000))
    server = start_drafter(loop, eng)
    client = GrpcDraftClient([server.address], round_deadline_s=PATIENT)
    try:
        got, _, verifier = _run(target, client, batch, 1, draft_ahead=True)
    finally:
        client.close()
        loop.run(server.stop(0))
    assert got == plain
    answers = eng.ahead_rounds // 2  # two rounds each, one sequence at a time
    assert client.stats.ahead_entries > 4 * answers > 0, "several hypotheses per answer"
    assert verifier.ahead_hits + verifier.ahead_misses > 0


def test_a_prefix_hit_goes_to_the_drafter_that_cached_it(models, drafters) -> None:
    """Two drafters; a sequence runs on one, and a second sharing its first blocks comes
    while it does. Least loaded alone sends the second to the idle drafter, which never
    computed those blocks: a miss and a resync (a dense recompute of the prefix). The
    hit goes where its blocks were sent, and reads them there; tokens equal plain's."""
    target, draft = models
    shared = [(7 * i) % target.config.vocab_size for i in range(1, 50)]  # 3 full blocks
    first, second = (shared + p for p in prompts(2, vocab=target.config.vocab_size, seed=4))
    want = outputs(engine(target), [first, second], 40)[0]
    a, b = drafters(2)
    client = GrpcDraftClient([a.address, b.address], round_deadline_s=PATIENT,
                             match=DrafterMatch(K, 32, target.config.vocab_size))
    drive = Driver(engine(target, client=client, k=K), max_tokens=40)
    (one,) = drive.add([first], "one")
    drive.step(4)  # its prompt's blocks are final in its drafter
    holder = a if client.loads()[a.address] else b
    (two,) = drive.add([second], "two")
    drive.finish()
    client.close()
    assert [drive.tokens[one], drive.tokens[two]] == want
    assert drive.eng.allocator.cache.hits > 0, "the second prompt hit the verifier's cache"
    assert drive.eng.resyncs == 0 and client.stats.affine_hits == 1
    assert holder.engine.allocator.cache.hits > 0
    other = b if holder is a else a
    assert other.engine.allocator.cache.queries == 0, "the idle drafter was never asked"


def test_two_drafters_share_sequences(models, batch, plain, drafters) -> None:
    a, b = drafters(2)
    client = GrpcDraftClient([a.address, b.address], round_deadline_s=PATIENT)
    drive = Driver(engine(models[0], client=client, k=K))
    ids = drive.add(batch, "r")
    drive.step_until(lambda: sum(client.loads().values()) == 8)
    assert client.loads() == {a.address: 4, b.address: 4}
    assert wait_until(lambda: a.engine.load == b.engine.load == 4)
    drive.finish()
    client.close()
    assert [drive.tokens[i] for i in ids] == plain
    assert drive.eng.resyncs == 0, "sticky: no update ever reached a drafter without its state"


def test_moved_sequences_keep_drafting(loop, models, batch, drafters) -> None:
    a, b = drafters(2)
    client = GrpcDraftClient([a.address, b.address], round_deadline_s=PATIENT)
    drive = Driver(engine(models[0], client=client, k=K), max_tokens=80)
    ids = drive.add(batch, "r")
    drive.step_until(lambda: sum(client.loads().values()) == 8)
    drive.step(2)
    loop.run(a.stop(None))  # abrupt: streams cancelled, no drain
    drive.step(3)  # every moved sequence has resynced onto b
    rounds = {i: drive.eng.by_id[i].stats.rounds for i in ids}
    drive.step(6)
    stuck = [i for i in ids if drive.eng.by_id[i].stats.rounds == rounds[i]]
    client.close()
    assert not stuck, f"no drafts since the move: {stuck}"


def _spawn_drafter(model_dir) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "chainspec.cli", "drafter", "--model", str(model_dir),
         "-k", str(K), "--max-len", "256", "--max-seqs", "8", "--model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("drafter serving "):
        proc.kill()
        raise AssertionError(f"drafter did not start: {line!r} {proc.stderr.read()}")
    return proc, line.split()[-1]


@pytest.mark.parametrize("groups,draft_ahead,depth_seed",
                         [(1, False, None), (2, False, None), (1, True, None), (1, False, 7)])
def test_drafter_killed_mid_run(models, model_dir, batch, plain, drafters, groups,
                                draft_ahead, depth_seed) -> None:
    """SIGKILL one drafter process (also during pipelined rounds, with draft-ahead, and
    under random verified and drafter-side depths, steps left lagging when it dies):
    every request completes with plain's output, and the lost drafter's sequences resync
    onto the survivor."""
    proc, victim = _spawn_drafter(model_dir)
    try:
        (survivor,) = drafters(1)
        client = GrpcDraftClient([victim, survivor.address], round_deadline_s=PATIENT)
        drive = Driver(engine(models[0], client=client, k=K, groups=groups,
                              draft_ahead=draft_ahead))
        if depth_seed is not None:
            drive.eng.depth = RandomDepth(depth_seed, K)
        ids = drive.add(batch, "r")
        drive.step_until(lambda: sum(client.loads().values()) == 8)
        drive.step(2)
        on_victim = client.loads()[victim]
        assert on_victim == 4
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        drive.step_until(lambda: client.states()[victim] is LinkState.DEAD)
        drive.step(2 * groups)  # the moved sequences resync (each group on its turn)
        running = drive.eng.num_running
        assert running > 0 and client.loads() == {survivor.address: running}
        assert wait_until(lambda: survivor.engine.load == running)
        drive.finish()
        client.close()
    finally:
        proc.kill()
        proc.wait(10)
    assert [drive.tokens[i] for i in ids] == plain
    assert depth_seed is None or {1, 2} <= set(drive.eng.depth.rounds)
    assert drive.eng.resyncs >= 1
    assert client.stats.stream_failures == 1
    assert 1 <= client.stats.reassignments <= on_victim  # moved to the survivor


def test_draining_drafter_hands_its_sequences_over(loop, models, batch, plain,
                                                   drafters) -> None:
    a, b = drafters(2, drain_grace_s=60)
    client = GrpcDraftClient([a.address, b.address], round_deadline_s=PATIENT)
    drive = Driver(engine(models[0], client=client, k=K))
    ids = drive.add(batch, "r")
    drive.step_until(lambda: sum(client.loads().values()) == 8)
    draining = loop.submit(a.drain())
    t0 = time.monotonic()
    drive.step_until(lambda: draining.done())
    assert time.monotonic() - t0 < 30, "the pool lets go at once, not after the grace"
    drive.step_until(lambda: client.loads() == {b.address: drive.eng.num_running}, limit=4)
    drive.finish()
    client.close()
    assert [drive.tokens[i] for i in ids] == plain
    assert drive.eng.resyncs >= 1 and client.stats.stream_failures == 0
    assert client.stats.reassignments >= 1


def test_set_endpoints_adds_and_removes_drafters(models, batch, plain, drafters) -> None:
    a, b = drafters(2)
    client = GrpcDraftClient([a.address], round_deadline_s=PATIENT)
    drive = Driver(engine(models[0], client=client, k=K))
    assert client.wait_connected(10) and client.accepting()
    first = drive.add(batch[:4], "x")
    drive.step_until(lambda: client.loads() == {a.address: 4})
    client.set_endpoints([a.address, b.address])
    assert client.wait_connected(10)
    second = drive.add(batch[4:], "y")
    drive.step_until(lambda: sum(client.loads().values()) == 8)
    assert client.loads() == {a.address: 4, b.address: 4}, "new sequences go to the new one"
    resyncs = drive.eng.resyncs
    client.set_endpoints([b.address])  # a leaves: its sequences move, nothing fails
    assert client.loads() == {b.address: 4}
    drive.step(3)
    assert client.loads() == {b.address: drive.eng.num_running}
    assert drive.eng.resyncs > resyncs
    assert wait_until(lambda: a.engine.load == 0), "a's stream closed: its state is freed"
    drive.finish()
    client.close()
    assert [drive.tokens[i] for i in first + second] == plain
    assert client.stats.stream_failures == 0


class _SlowEngine:
    def __init__(self, engine, delay: float) -> None:
        self.engine, self.delay = engine, delay

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update(self, updates):
        time.sleep(self.delay)
        return self.engine.update(updates)


def test_slow_drafter_costs_speed_not_output(loop, models, batch, plain) -> None:
    slow = _SlowEngine(drafter_engine(copy.deepcopy(models[1]), k=K), delay=0.15)
    srv = start_drafter(loop, slow)
    deadline = 0.02
    client = GrpcDraftClient([srv.address], round_deadline_s=deadline)
    try:
        got = outputs(engine(models[0], client=client, k=K), batch[:4], MAX_TOKENS)[0]
    finally:
        client.close()
        loop.run(srv.stop(0))
    assert got == plain[:4]
    s = client.stats
    assert s.late_batches > 0
    assert s.wait_s_total / s.rounds < 0.06, "collect waits out the deadline, not the drafter"


def test_without_drafters_every_update_is_answered_locally(models, batch, plain) -> None:
    client = GrpcDraftClient([])
    eng = engine(models[0], client=client, k=K)
    got = outputs(eng, batch[:2], MAX_TOKENS)[0]
    assert got == plain[:2]
    assert client.stats.local_failures >= 2 and client.stats.batches_sent == 0
    # no drafter accepts: the engine recomputes no prefix for a resync that would fail
    assert not client.accepting() and eng.resyncs == 0
    # a sequence that found no drafter is not asked to resync (it would find none again)
    client.submit([SeqUpdate(5, 0, (1, 2), torch.zeros(2, 32))])
    client.submit([SeqUpdate(5, 2, (3,), torch.zeros(1, 32))])
    assert client.collect()[5].code is ErrorCode.UNAVAILABLE
    client.submit([SeqUpdate(6, 4, (3,), torch.zeros(1, 32))])  # unknown: resync
    assert client.collect()[6].code is ErrorCode.FAILED_PRECONDITION

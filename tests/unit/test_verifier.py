"""Verifier engine: losslessness across configurations and under drafter faults, stop
conditions, cancellation, admission errors."""

from __future__ import annotations

import random

import pytest
import torch

from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.draft_types import DraftResult, ErrorCode, SeqFailure
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.request import FinishReason, StopConditions
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


@pytest.fixture(scope="module")
def plain_reference(pair):
    target, _ = pair
    return outputs(engine(target), prompts(8))[0]


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_speculative_equals_plain(pair, plain_reference, k, batch, chain) -> None:
    target, draft = pair
    got = []
    eng = engine(target, draft, k=k, chain=chain, max_seqs=batch)
    ps = prompts(8)
    for i in range(0, 8, batch):
        got += outputs(eng, ps[i:i + batch])[0]
    assert got == plain_reference


def test_chunked_prefill_is_lossless(pair, plain_reference) -> None:
    target, draft = pair
    assert outputs(engine(target, draft, chunk=5), prompts(8))[0] == plain_reference
    assert outputs(engine(target, None, chunk=3), prompts(8))[0] == plain_reference


def test_oracle_drafter_is_fully_accepted(pair) -> None:
    """A drafter that proposes exactly the target's greedy continuation gets every draft
    accepted: acceptance is measured, not assumed."""
    target, _ = pair
    ps = prompts(3)
    truth = outputs(engine(target), ps, max_tokens=40)[0]
    eng = engine(target, k=3, client=OracleClient(ps, truth, 3))
    got, result = outputs(eng, ps, max_tokens=40)
    assert got == truth
    stats = [c.stats for c in result.completions]
    assert all(s.accepted_tokens == s.draft_tokens > 0 for s in stats)
    assert all(s.acceptance_length > 3.5 for s in stats)


class OracleClient:
    """Proposes the true next K tokens of each sequence (known in advance)."""

    def __init__(self, ps, truth, k) -> None:
        self.full = {i: list(p) + list(t) for i, (p, t) in enumerate(zip(ps, truth, strict=True))}
        self.k, self.ready = k, {}

    def submit(self, updates) -> None:
        for u in updates:
            n = u.start + len(u.tokens)  # index of the newest committed token
            seq = self.full[u.seq_id]
            drafts = (seq[n + 1:n + 1 + self.k] + [0] * self.k)[: self.k]
            self.ready[u.seq_id] = DraftResult(u.seq_id, n, torch.tensor(drafts))

    def collect(self, wait_for=None):
        ready, self.ready = self.ready, {}
        return ready

    def release(self, ids) -> None:
        pass


class FaultyClient(LocalDraftClient):
    """Loses, garbles and desyncs drafter state at random; output must not change."""

    def __init__(self, drafter: DrafterEngine, seed: int) -> None:
        super().__init__(drafter)
        self.rng = random.Random(seed)
        self.faults = {"late": 0, "garbled": 0, "restart": 0}

    def collect(self, wait_for=None):
        out = {}
        for seq_id, outcome in super().collect().items():
            roll = self.rng.random()
            if roll < 0.15:
                self.faults["late"] += 1  # never arrives: plain decode this round
                continue
            if roll < 0.3 and isinstance(outcome, DraftResult):
                self.faults["garbled"] += 1  # wrong proposal
                outcome = DraftResult(seq_id, outcome.position,
                                      torch.randint(0, 61, outcome.tokens.shape))
            elif roll < 0.4:
                self.faults["restart"] += 1  # the drafter lost the sequence
                self.engine.release([seq_id])
                outcome = SeqFailure(seq_id, ErrorCode.FAILED_PRECONDITION, "restarted")
            out[seq_id] = outcome
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafter_faults_never_change_output(pair, temperature) -> None:
    target, draft = pair
    ps = prompts(8, seed=3)
    seeds = list(range(8))
    reference = outputs(engine(target), ps, 30, temperature, seeds)[0]
    drafter = DrafterEngine(draft, DrafterConfig(num_steps=3, max_seqs=8, max_len=256, top_k=4))
    client = FaultyClient(drafter, seed=1)
    eng = engine(target, k=3, client=client, sampled_drafts=False)
    got, result = outputs(eng, ps, 30, temperature, seeds)
    assert got == reference  # seeded sampling too: the coupled rule (DESIGN 3.3)
    assert min(client.faults.values()) > 0
    assert eng.resyncs > 0
    assert sum(c.stats.fallback_rounds for c in result.completions) > 0


def test_stop_conditions(pair) -> None:
    target, draft = pair
    ps = prompts(4, seed=5)
    free = outputs(engine(target), ps, 30)[0]
    stop_tok = free[0][5]
    eng = engine(target, draft, eos_ids=[free[1][3]])
    params = SamplingParams(temperature=0.0)
    eng.add_request("a", ps[0], params, StopConditions(max_tokens=30, stop_token_ids=(stop_tok,)))
    eng.add_request("b", ps[1], params, StopConditions(max_tokens=30))
    eng.add_request("c", ps[2], params, StopConditions(max_tokens=7))
    eng.add_request("d", ps[1], params, StopConditions(max_tokens=30, ignore_eos=True))
    got, reasons = {k: [] for k in "abcd"}, {}
    while eng.has_work:
        for out in eng.step():
            got[out.request_id] += out.new_tokens
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    first = free[0].index(stop_tok)
    assert got["a"] == free[0][:first + 1] and reasons["a"] is FinishReason.STOP
    eos_at = free[1].index(free[1][3])
    assert got["b"] == free[1][:eos_at + 1] and reasons["b"] is FinishReason.EOS
    assert got["c"] == free[2][:7] and reasons["c"] is FinishReason.LENGTH
    assert got["d"] == free[1] and reasons["d"] is FinishReason.LENGTH


def test_stop_string(pair) -> None:
    target, draft = pair
    ps = prompts(1, seed=6)
    free = outputs(engine(target), ps, 20)[0][0]

    def detok(ids):
        return "".join(f"<{i}>" for i in ids)

    needle = detok(free[4:6])
    outs = _run_with_stop_string(engine(target, draft, detokenize=detok), ps[0], 20, needle)
    tokens = [t for o in outs for t in o.new_tokens]
    assert tokens == free[:6]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_string == needle


def _run_with_stop_string(eng, prompt: list[int], max_tokens: int, needle: str) -> list:
    """One greedy request stopped by `needle`, run to its end: every output it made."""
    eng.add_request("s", prompt, SamplingParams(temperature=0.0),
                    StopConditions(max_tokens=max_tokens, stop_strings=(needle,)))
    outs = []
    while eng.has_work:
        outs += eng.step()
    return outs


def test_stop_string_at_the_first_token_reads_it_in_context(pair) -> None:
    """A Metaspace-like decoder drops the first token's leading space when the token is
    decoded alone ("w7", not " w7"), but streams it after the prompt as " w7". A stop
    string " w7" at the first output token must stop the request there."""
    target, draft = pair
    ps = prompts(1, seed=6)
    free = outputs(engine(target), ps, 12)[0][0]

    def detok(ids):  # each token is " w<i>"; the decoder strips one leading space
        return "".join(f" w{i}" for i in ids).removeprefix(" ")

    needle = f" w{free[0]}"
    outs = _run_with_stop_string(engine(target, draft, detokenize=detok), ps[0], 12, needle)
    assert [t for o in outs for t in o.new_tokens] == free[:1]
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_string == needle


def test_abort_frees_slot_and_drafter_state(pair) -> None:
    target, draft = pair
    eng = engine(target, draft, max_seqs=2)
    params = SamplingParams(temperature=0.0)
    for rid in ("x", "y", "z"):
        eng.add_request(rid, prompts(1)[0], params, StopConditions(max_tokens=50))
    eng.step()
    eng.step()
    assert eng.abort("x") and eng.abort("z")  # x is running, z still waiting
    finished = {o.request_id: o.finish_reason for o in eng.step() if o.finished}
    assert finished == {"x": FinishReason.ABORT, "z": FinishReason.ABORT}
    assert eng.num_running == 1
    assert eng.drafter.engine.load == 1
    while eng.has_work:
        eng.step()
    assert eng.drafter.engine.load == 0 and eng.allocator.num_used == 0


@pytest.mark.parametrize("prompt,stop,message", [
    ([], StopConditions(), "at least one token"),
    ([61], StopConditions(), "token ids"),
    ([1] * 240, StopConditions(max_tokens=20), "context limit"),
])
def test_admission_errors(pair, prompt, stop, message) -> None:
    target, _ = pair
    eng = engine(target)
    with pytest.raises(ValueError, match=message):
        eng.add_request("bad", prompt, SamplingParams(temperature=0.0), stop)
    assert not eng.has_work


def test_sampled_output_is_reproducible_per_seed(pair) -> None:
    """A seeded request's tokens are the plain keyed samples: the same with or without
    drafts, alone or batched, at any K, with sampled or greedy drafts."""
    target, draft = pair
    ps = prompts(3, seed=9)
    plain = outputs(engine(target), ps, 15, 0.8, [1, 2, 3])[0]
    a = outputs(engine(target, draft), ps, 15, 0.8, [1, 2, 3])[0]
    b = outputs(engine(target, draft, max_seqs=1), ps, 15, 0.8, [1, 2, 3])[0]
    d = outputs(engine(target, draft, k=2, sampled_drafts=False), ps, 15, 0.8, [1, 2, 3])[0]
    c = outputs(engine(target, draft), ps, 15, 0.8, [4, 5, 6])[0]
    assert plain == a == b == d != c
    # the tiny random pair rarely agrees when sampling: an oracle puts drafts at stake
    oracle, result = outputs(engine(target, k=3, client=OracleClient(ps, plain, 3)), ps, 15,
                             0.8, [1, 2, 3])
    assert oracle == plain
    assert all(x.stats.acceptance_length > 3.5 for x in result.completions)


class OutageClient(LocalDraftClient):
    """The drafter refuses every sequence (UNAVAILABLE) until `outage` collects have passed,
    as when the only drafter is down; then it serves again."""

    def __init__(self, drafter: DrafterEngine, outage: int) -> None:
        super().__init__(drafter)
        self.outage = outage

    def collect(self, wait_for=None):
        ready = super().collect()
        if self.outage <= 0:
            return ready
        self.outage -= 1
        for seq_id in ready:
            self.engine.release([seq_id])
        return {s: SeqFailure(s, ErrorCode.UNAVAILABLE, "no drafter") for s in ready}


def test_speculation_resumes_after_a_drafter_outage(pair) -> None:
    target, draft = pair
    ps = prompts(3, seed=11)
    reference = outputs(engine(target), ps, 60)[0]
    drafter = DrafterEngine(draft, DrafterConfig(num_steps=3, max_seqs=8, max_len=256))
    eng = engine(target, k=3, client=OutageClient(drafter, outage=5))
    got, result = outputs(eng, ps, 60)
    assert got == reference
    stats = [c.stats for c in result.completions]
    assert all(s.fallback_rounds > 0 for s in stats)  # the outage was felt
    assert all(s.rounds > 3 for s in stats)  # and speculation came back for every request


class SayingOutageClient(OutageClient):
    """An OutageClient that says so (`accepting`), as the gRPC pool does with no live
    drafter."""

    def accepting(self) -> bool:
        return self.outage <= 0


@pytest.mark.parametrize("outage", [5, 10_000])
def test_no_resync_recompute_while_no_drafter_accepts(pair, outage) -> None:
    """A resync recomputes the prefix: with no drafter to take it, none runs (before, one
    ran per backoff period for nothing); once one accepts, sequences resync and
    speculate again. Output is the plain output either way."""
    target, draft = pair
    ps = prompts(3, seed=11)
    reference = outputs(engine(target), ps, 60)[0]
    drafter = DrafterEngine(draft, DrafterConfig(num_steps=3, max_seqs=8, max_len=256))
    eng = engine(target, k=3, client=SayingOutageClient(drafter, outage=outage))
    got, result = outputs(eng, ps, 60)
    assert got == reference
    stats = [c.stats for c in result.completions]
    if outage > 100:  # never over: no recompute at all, no drafts
        assert eng.resyncs == 0 and all(s.draft_tokens == 0 for s in stats)
    else:
        assert eng.resyncs > 0 and all(s.rounds > s.fallback_rounds for s in stats)

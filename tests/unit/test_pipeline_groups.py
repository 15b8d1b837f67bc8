"""Pipelined groups (DESIGN 4.8): sequences take turns in groups, a step waits only for
its own group's drafts, and every sequence's rounds are exactly those of the unpipelined
engine (same drafts, same acceptance), so output is unchanged."""

from __future__ import annotations

import time

import pytest

from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.request import StopConditions
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


def _stats(result):
    return [(c.stats.rounds, c.stats.accepted_tokens, tuple(c.stats.accepted_per_pos))
            for c in result.completions]


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_groups_change_nothing_a_sequence_sees(pair, groups, chain, temperature) -> None:
    target, draft = pair
    ps = prompts(8, seed=4)
    want, want_result = outputs(engine(target, draft, chain=chain), ps, 24, temperature)
    got, result = outputs(engine(target, draft, chain=chain, groups=groups), ps, 24,
                          temperature)
    assert got == want
    assert _stats(result) == _stats(want_result), "each sequence drafts exactly as before"
    if temperature == 0.0:
        assert got == outputs(engine(target), ps, 24)[0]  # lossless vs plain


def test_admission_balances_groups_and_turns_skip_empty_groups(pair) -> None:
    target, draft = pair
    eng = engine(target, draft, groups=2)
    seen = []
    step = eng.step

    def spy():
        out = step()
        seen.append(sorted(r.group for r in eng.running))
        return out
    eng.step = spy
    outputs(eng, prompts(5, seed=2), 8)
    assert seen[0] == [0, 0, 0, 1, 1]
    one = engine(target, draft, groups=2)
    steps = len(outputs(one, prompts(1), 8)[1].completions[0].tokens)
    assert one.steps <= steps + 2, "a lone sequence does not wait for an empty group"


class DelayedDrafter:
    """A DraftClient whose drafts arrive `delay_s` after submit (a remote drafter). At each
    collect it logs what the step asked to wait for and what was still in flight after."""

    def __init__(self, drafter: DrafterEngine, delay_s: float) -> None:
        self.engine, self.delay_s = drafter, delay_s
        self.inbox: dict[int, tuple[float, object]] = {}  # seq_id -> (arrival, outcome)
        self.log: list[tuple[frozenset[int] | None, frozenset[int]]] = []

    def submit(self, updates) -> None:
        arrival = time.monotonic() + self.delay_s
        for u, outcome in zip(updates, self.engine.update(updates), strict=True):
            self.inbox[u.seq_id] = (arrival, outcome)

    def collect(self, wait_for=None):
        due = [t for s, (t, _) in self.inbox.items() if wait_for is None or s in wait_for]
        time.sleep(max(0.0, max(due, default=0.0) - time.monotonic()))
        now = time.monotonic()
        ready = {s: o for s, (t, o) in self.inbox.items() if t <= now}
        for s in ready:
            del self.inbox[s]
        self.log.append((None if wait_for is None else frozenset(wait_for),
                         frozenset(self.inbox)))
        return ready

    def release(self, seq_ids) -> None:
        for s in seq_ids:
            self.inbox.pop(s, None)
        self.engine.release(seq_ids)


def _delayed(draft, delay_s: float = 0.02) -> DelayedDrafter:
    return DelayedDrafter(DrafterEngine(draft, DrafterConfig(num_steps=3, max_seqs=8,
                                                             max_len=256, top_k=4)), delay_s)


def test_a_forward_runs_while_the_other_groups_drafts_are_in_flight(pair) -> None:
    target, draft = pair
    ps = prompts(6, seed=8)
    plain = outputs(engine(target), ps, 16)[0]
    client = _delayed(draft)
    eng = engine(target, client=client, groups=2)
    got, result = outputs(eng, ps, 16)
    assert got == plain
    assert sum(c.stats.accepted_tokens for c in result.completions) > 0
    overlapped = 0
    for wait_for, in_flight in client.log:
        if wait_for is None:  # one group left running (the other finished): nothing to hide
            continue
        assert not wait_for & in_flight, "a step verifies only drafts that are in"
        overlapped += bool(in_flight)
    assert overlapped >= len(client.log) // 2, "the other group's drafts were computing"


def test_without_groups_every_step_waits_for_every_draft(pair) -> None:
    target, draft = pair
    client = _delayed(draft)
    outputs(engine(target, client=client), prompts(6, seed=8), 16)
    assert all(wait_for is None and not in_flight for wait_for, in_flight in client.log)


def test_metrics_report_the_groups_taking_turns(pair) -> None:
    from chainspec.metrics.verifier import VerifierMetrics

    target, draft = pair
    for groups, want in ((1, 1.0), (2, 2.0)):
        vm = VerifierMetrics("tiny", 3)
        eng = engine(target, draft, groups=groups)
        eng.observer = vm
        eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0),
                        StopConditions(max_tokens=8))
        eng.add_request("b", [4, 5], SamplingParams(temperature=0.0),
                        StopConditions(max_tokens=8))
        eng.step()
        assert vm.registry.get_sample_value("chainspec_pipeline_groups",
                                            {"model_name": "tiny"}) == want

"""Draft-ahead's hit path on the demo model (DESIGN 4.8): a hit's next round verifies the
look-ahead's K drafts (a hit loses no draft), the update tells the drafter so, the step
that runs it waits for no drafts, and more hypotheses hit more often."""

from __future__ import annotations

import dataclasses
import time

import pytest

from chainspec.engine import verifier as verifier_module
from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import build_verifier
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.verifier import VerifierEngine

GREEDY = SamplingParams(temperature=0.0)
STOP = StopConditions(max_tokens=40, ignore_eos=True)


def _engine(demo_models, k: int, client=None, **config) -> VerifierEngine:
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=k)
    eng = build_verifier(models, opts, speculative=client is None)
    if client is not None:
        eng.drafter = client
    eng.config = dataclasses.replace(eng.config, **config)
    return eng


def _full_k(demo_models, **ahead) -> LocalDraftClient:
    """An in-process drafter whose look-aheads always run their second round (full K
    drafts for the bonus guesses too), whatever the timing."""
    opts, models = demo_models
    return LocalDraftClient(DrafterEngine(models.draft, DrafterConfig(
        num_steps=3, max_seqs=8, max_len=opts.max_len,
        **{"ahead_rows": 10_000, "ahead_second_round": True, **ahead})))


def _plain(demo_models, prompts):
    opts, models = demo_models
    eng = build_verifier(models, opts, speculative=False)
    return [c.tokens for c in run_to_completion(eng, prompts, GREEDY, STOP).completions]


@pytest.mark.parametrize("groups", [1, 2])
def test_hits_verify_the_look_ahead_drafts_and_tell_the_drafter(demo_models, heldout_prompts,
                                                                 groups, monkeypatch) -> None:
    prompts = heldout_prompts[:4]
    eng = _engine(demo_models, 3, client=_full_k(demo_models), draft_ahead=True,
                  groups=groups)
    sent, verified = [], []
    submit = eng.drafter.submit
    monkeypatch.setattr(eng.drafter, "submit", lambda ups: (sent.extend(ups), submit(ups)))
    run_verify = verifier_module.run_verify

    def spy(model, cache, work, device, *graphs):
        verified.extend(w for w in work if w.ahead)
        return run_verify(model, cache, work, device, *graphs)
    monkeypatch.setattr(verifier_module, "run_verify", spy)
    got = [c.tokens for c in run_to_completion(eng, prompts, GREEDY, STOP).completions]
    assert got == _plain(demo_models, prompts)
    # every hit's next round verifies the look-ahead, unless the hit ended its request
    assert eng.ahead_hits - len(prompts) <= len(verified) <= eng.ahead_hits
    assert len(verified) > 0
    assert all(w.num_drafts == 3 for w in verified), "a look-ahead proposes K drafts"
    told = [u for u in sent if u.verifying]
    assert len(told) == len(verified), "each hit round's update names its drafts"
    assert all(len(u.verifying) == 3 and u.look_ahead for u in told)


class SlowDrafter(LocalDraftClient):
    """Exact drafts are due `delay_s` after submit (look-aheads come with them). Logs,
    per collect, what the step asked to wait for."""

    def __init__(self, engine: DrafterEngine, delay_s: float) -> None:
        super().__init__(engine)
        self.delay_s = delay_s
        self.due: dict[int, float] = {}
        self.log: list[frozenset[int] | None] = []

    def submit(self, updates) -> None:
        for u in updates:
            self.due[u.seq_id] = time.monotonic() + self.delay_s
        super().submit(updates)

    def collect(self, wait_for=None):
        self.log.append(None if wait_for is None else frozenset(wait_for))
        waits = [t for s, t in self.due.items() if wait_for is None or s in wait_for]
        time.sleep(max(0.0, max(waits, default=0.0) - time.monotonic()))
        self.due.clear()
        return super().collect(wait_for)


def test_a_hit_round_waits_for_no_drafts(demo_models, heldout_prompts) -> None:
    opts, models = demo_models
    client = SlowDrafter(DrafterEngine(models.draft, DrafterConfig(
        num_steps=3, max_seqs=8, max_len=opts.max_len)), 0.005)
    eng = _engine(demo_models, 3, client=client, draft_ahead=True)
    prompts = heldout_prompts[:1]
    got = [c.tokens for c in run_to_completion(eng, prompts, GREEDY, STOP).completions]
    assert got == _plain(demo_models, prompts)
    assert eng.ahead_hits > 0
    # the step after each hit (and only then) waits for no drafts; a hit on the
    # request's last round has no step after it
    assert eng.ahead_hits - 1 <= client.log.count(frozenset()) <= eng.ahead_hits
    assert all(w == {0} for w in client.log if w), "other steps wait for exact drafts"


def test_metrics_count_hits_misses_and_look_ahead_acceptance(demo_models,
                                                             heldout_prompts) -> None:
    from chainspec.metrics.verifier import VerifierMetrics

    vm = VerifierMetrics("demo", 3)
    eng = _engine(demo_models, 3, client=_full_k(demo_models), draft_ahead=True)
    eng.observer = vm
    verified = []
    run_verify = verifier_module.run_verify

    def spy(model, cache, work, device, *graphs):
        result = run_verify(model, cache, work, device, *graphs)
        verified.extend((w, v.accepted) for w, v in zip(work, result.verdicts, strict=True)
                        if w.ahead)
        return result
    verifier_module.run_verify = spy
    try:
        run_to_completion(eng, heldout_prompts[:6], GREEDY, STOP)
    finally:
        verifier_module.run_verify = run_verify

    def value(name: str, **labels) -> float:
        return vm.registry.get_sample_value(name, {"model_name": "demo", **labels}) or 0.0
    assert value("chainspec_draft_ahead_verdicts_total", result="hit") == eng.ahead_hits > 0
    assert value("chainspec_draft_ahead_verdicts_total", result="miss") == eng.ahead_misses
    assert value("chainspec_draft_ahead_draft_tokens_total") == 3 * len(verified)
    per_pos = [value("chainspec_draft_ahead_accepted_tokens_per_pos_total", position=str(i))
               for i in range(3)]
    assert per_pos == [sum(a > i for _, a in verified) for i in range(3)]
    assert per_pos[0] >= per_pos[1] >= per_pos[2] > 0


def _hit_rate(demo_models, prompts, **ahead) -> tuple[VerifierEngine, float]:
    eng = _engine(demo_models, 3, client=_full_k(demo_models, **ahead), draft_ahead=True)
    for p in prompts:  # one at a time: the budget is the sequence's alone
        got = run_to_completion(eng, [p], GREEDY, STOP).completions[0].tokens
        assert got == _plain(demo_models, [p])[0]
    return eng, eng.ahead_hits / (eng.ahead_hits + eng.ahead_misses)


def test_more_hypotheses_hit_more_often(demo_models, heldout_prompts) -> None:
    prompts = heldout_prompts[:3]
    # one hypothesis: the bonus pass alone (2 history rows + 3; no second round, where
    # corrections compete with the full-K drafts of bonus guesses)
    one, single = _hit_rate(demo_models, prompts, ahead_fanout=1, ahead_rows=5,
                            ahead_second_round=False)
    many, multi = _hit_rate(demo_models, prompts, ahead_fanout=2, ahead_rows=10_000)
    assert set(one.ahead_rank_hits) == {0}
    assert multi > single, (multi, single)
    assert sum(v for r, v in many.ahead_rank_hits.items() if r > 0) > 0
    assert sum(many.ahead_rank_hits.values()) == many.ahead_hits

"""Adaptive depth (DESIGN 4.11) verifies no draft a request cannot commit: with r tokens
left to max_tokens a window keeps at most r - 1 drafts and the bonus token, so the policy
weighs (and the verifier verifies) no more than that."""

import dataclasses

from chainspec.engine.adaptive_depth import AdaptiveDepth
from chainspec.engine.schedule import WorkKind
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair

K, MAX_TOKENS = 3, 7


class Windows:
    """Every verify window's drafts, beside the drafts its request could still commit."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def request_added(self, *args) -> None:
        pass

    def step_done(self, step) -> None:
        for w in step.work:
            if w.kind is WorkKind.VERIFY:
                generated = w.start + 1 - w.request.prompt_len  # committed before the step
                self.seen.append((w.num_drafts, MAX_TOKENS - generated - 1))

    def __getattr__(self, name):  # the observer's other notices: not this test's
        return lambda *args, **kwargs: None


class Deepest(AdaptiveDepth):
    """A policy that verifies all it is allowed: what the verifier allows, laid bare."""

    def depths(self, keys, caps, other_rows=0, demand=0):
        return list(caps)


def test_no_window_verifies_drafts_past_max_tokens():
    target, draft = tied_pair()
    plain, _ = outputs(engine(target), prompts(6), max_tokens=MAX_TOKENS)
    eng = engine(target, draft, k=K)
    eng.config = dataclasses.replace(eng.config, adaptive_depth=True)
    eng.depth = Deepest(K)
    eng.observer = windows = Windows()
    got, _ = outputs(eng, prompts(6), max_tokens=MAX_TOKENS)
    assert got == plain
    # drafts in hand: K, to what the request can still commit
    assert windows.seen and all(drafts == min(K, budget) for drafts, budget in windows.seen)
    assert {min(K, budget) for _, budget in windows.seen} >= {K, 1}  # the cap was at stake


def test_nothing_to_draft_is_no_plain_decision():
    # every sequence at its last token: no choice made, so no plain spell begins
    policy = AdaptiveDepth(num_steps=3)
    policy.observe_step(4, 5.0, 0.0, 0.0, asked=True)
    policy.drafting_steps = 7
    assert policy.depths([0, 1], [0, 0]) == [0, 0]
    assert (policy.plain_steps, policy.drafting_steps) == (0, 7)

"""The demo model under adaptive draft depth (DESIGN 4.11): greedy output equals plain at
batch 1, 3 and 8, whatever depths the policy picks -- its own choices, and random
depths 0..K forced on every round -- and a request's cap is honoured."""

from __future__ import annotations

import dataclasses

import pytest

from chainspec.engine.local import build_verifier
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import RandomDepth

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0)
STOP = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)


def run(eng, prompts, batch):
    tokens, completions = [], []
    for i in range(0, len(prompts), batch):
        result = run_to_completion(eng, prompts[i:i + batch], GREEDY, STOP)
        tokens += [c.tokens for c in result.completions]
        completions += result.completions
    return tokens, completions


@pytest.fixture(scope="module")
def plain(demo_models, heldout_prompts):
    opts, models = demo_models
    return run(build_verifier(models, opts, False), heldout_prompts, 8)[0]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_adaptive_depth_equals_plain(demo_models, heldout_prompts, plain, batch):
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=3, speculative_depth="adaptive")
    eng = build_verifier(models, opts, True)
    assert eng.depth is not None
    tokens, completions = run(eng, heldout_prompts, batch)
    assert tokens == plain
    stats = merged_stats(completions, opts.num_steps)
    assert stats.draft_tokens > 0  # the policy did verify drafts


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_random_depths_equal_plain(demo_models, heldout_prompts, plain, batch):
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=3, speculative_depth="adaptive")
    eng = build_verifier(models, opts, True)
    eng.depth = RandomDepth(batch, opts.num_steps)
    tokens, completions = run(eng, heldout_prompts, batch)
    assert tokens == plain
    assert set(eng.depth.chosen) == {0, 1, 2, 3}  # every depth was at stake
    assert set(eng.depth.rounds) == {1, 2, 3}  # and rounds of 1, 2 and 3 draft steps
    stats = merged_stats(completions, opts.num_steps)
    assert stats.accepted_tokens > 0.2 * stats.draft_tokens


@pytest.mark.parametrize("depth", ["fixed", "adaptive"])
def test_request_cap_is_honoured(demo_models, heldout_prompts, plain, depth):
    """Cap 0: no drafts verified, the drafter not asked; cap 1: one per round at fixed
    depth, at most one under the policy."""
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=3, speculative_depth=depth)
    eng = build_verifier(models, opts, True)
    prompts = heldout_prompts[:4]
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, GREEDY, STOP, num_speculative_tokens=[0, 1, 0, 1][i])
    done = {}
    while eng.has_work:
        for out in eng.step():
            done.setdefault(out.request_id, []).extend(out.new_tokens)
            if out.stats is not None:
                done[out.request_id + "/stats"] = out.stats
    for i in range(4):
        assert done[f"r{i}"] == plain[i]
        stats = done[f"r{i}/stats"]
        if i % 2 == 0:
            assert (stats.rounds, stats.draft_tokens) == (0, 0)
        elif depth == "fixed":
            assert stats.rounds > 0 and stats.draft_tokens == stats.rounds  # one each
        else:  # the policy may verify fewer, never more
            assert stats.draft_tokens <= stats.rounds
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        eng.add_request("bad", prompts[0], GREEDY, STOP, num_speculative_tokens=-1)


class PlainSpells(RandomDepth):
    """Every verify window at depth 0 on steps `start <= n < stop` of the engine, its cap
    otherwise."""

    def __init__(self, engine, start: int, stop: int) -> None:
        super().__init__(0)
        self.engine, self.start, self.stop = engine, start, stop

    @property
    def plain_steps(self) -> int:
        return int(self.start <= self.engine.steps < self.stop)

    def depths(self, keys, caps, other_rows=0, demand=0):
        return [0] * len(caps) if self.plain_steps else list(caps)


def test_steps_that_draft_nothing_run_no_draft_round(demo_models, heldout_prompts, plain):
    """While every sequence is at depth 0 the drafter gets no update (no round); the rows
    it missed go with the next update, and drafts are as good afterwards."""
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=3, speculative_depth="adaptive")
    eng = build_verifier(models, opts, True)
    eng.depth = PlainSpells(eng, 4, 12)
    sent: list[tuple[int, list]] = []
    inner = eng.drafter.submit
    eng.drafter.submit = lambda updates: (sent.append((eng.steps, list(updates))),
                                          inner(updates))[1]
    tokens, completions = run(eng, heldout_prompts[:3], 3)
    assert tokens == plain[:3]
    assert not [s for s, _ in sent if 4 <= s < 12]  # no round while nobody drafts
    resumed = next(ups for s, ups in sent if s >= 12)
    assert all(len(u.tokens) >= 8 for u in resumed)  # the held rows went with it
    stats = merged_stats(completions, opts.num_steps)
    assert stats.accepted_tokens > 0.3 * stats.draft_tokens  # the drafter stayed in sync


def test_prompts_that_arrive_while_nobody_drafts_wait_too(demo_models, heldout_prompts, plain):
    """Prompts admitted in a plain spell send the drafter nothing; their first update
    asks from position 0, prompt and output rows together."""
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=3, speculative_depth="adaptive")
    eng = build_verifier(models, opts, True)
    eng.depth = PlainSpells(eng, 0, 10)
    sent: list[tuple[int, list]] = []
    inner = eng.drafter.submit
    eng.drafter.submit = lambda updates: (sent.append((eng.steps, list(updates))),
                                          inner(updates))[1]
    tokens, completions = run(eng, heldout_prompts[:2], 2)
    assert tokens == plain[:2]
    assert sent and sent[0][0] >= 10
    first = sent[0][1]
    assert [u.start for u in first] == [0, 0]
    assert all(len(u.tokens) > len(p) for u, p in zip(first, heldout_prompts, strict=False))
    stats = merged_stats(completions, opts.num_steps)
    assert stats.accepted_tokens > 0.3 * stats.draft_tokens

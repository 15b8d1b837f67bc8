"""The demo model: greedy speculative output equals greedy plain output, token for token,
over 20+ held-out prompts, K = 1..4, batch sizes 1, 3 and 8, chain and non-chain, with
two pipelined groups at batch 8, and with draft-ahead at every batch size."""

from __future__ import annotations

import dataclasses

import pytest

from chainspec.engine.local import build_verifier
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0)


def generate(models, opts, prompts, speculative: bool, batch: int, groups: int = 1,
             draft_ahead: bool = False):
    eng = build_verifier(models, opts, speculative)
    eng.config = dataclasses.replace(eng.config, groups=groups, draft_ahead=draft_ahead)
    stop = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens, completions = [], []
    for i in range(0, len(prompts), batch):
        result = run_to_completion(eng, prompts[i:i + batch], GREEDY, stop)
        tokens += [c.tokens for c in result.completions]
        completions += result.completions
    generate.engine = eng  # the last engine, for its look-ahead counts
    return tokens, merged_stats(completions, opts.num_steps)


@pytest.fixture(scope="module")
def plain(demo_models, heldout_prompts):
    opts, models = demo_models
    return generate(models, opts, heldout_prompts, speculative=False, batch=8)[0]


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "nonchain"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_speculative_equals_plain(demo_models, heldout_prompts, plain, k, batch, chain):
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=k, chain=chain)
    tokens, stats = generate(models, opts, heldout_prompts, speculative=True, batch=batch)
    assert tokens == plain
    assert stats.accepted_tokens > 0.2 * stats.draft_tokens  # drafts were really at stake


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "nonchain"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_pipelined_groups_equal_plain(demo_models, heldout_prompts, plain, k, chain):
    """Two groups taking turns (DESIGN 4.8) at batch 8: the same tokens as plain."""
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=k, chain=chain)
    tokens, stats = generate(models, opts, heldout_prompts, speculative=True, batch=8,
                             groups=2)
    assert tokens == plain
    assert stats.accepted_tokens > 0.2 * stats.draft_tokens


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "nonchain"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_draft_ahead_equals_plain(demo_models, heldout_prompts, plain, k, batch, chain):
    """Look-ahead drafts (DESIGN 4.8) used on every hit: the same tokens as plain."""
    opts, models = demo_models
    opts = dataclasses.replace(opts, num_steps=k, chain=chain)
    tokens, stats = generate(models, opts, heldout_prompts, speculative=True, batch=batch,
                             draft_ahead=True)
    assert tokens == plain
    assert stats.accepted_tokens > 0.2 * stats.draft_tokens
    eng = generate.engine
    if k > 1:  # K = 1 has nothing to look ahead with (a look-ahead proposes K - 1 drafts)
        assert eng.ahead_hits > 0.2 * (eng.ahead_hits + eng.ahead_misses)

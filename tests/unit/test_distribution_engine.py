"""End-to-end losslessness under sampling: through the real verifier and drafter, the joint
distribution of the first two generated tokens is the same with and without speculation,
for point-mass and top-k draft distributions, for seeded requests (the coupled rule) and
unseeded ones (Leviathan's); a broken acceptance rule is caught."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from chainspec.engine import acceptance, verify_batch
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import engine, tied_pair
from tests.unit.stats import chi_square_two_sample

VOCAB, REQUESTS, BATCH = 8, 3000, 100
PROMPT = [1, 5, 2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threading costs more than it saves here
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    target, draft = tied_pair(vocab=VOCAB, modules=2, seed=4)
    with torch.no_grad():  # soften both so that p and q overlap but differ
        target.lm_head.weight.mul_(0.15)
    return target, draft


def unseeded_drawing(seeds):
    """Requests sent without a seed draw theirs from `seeds` at admission (reproducible
    tests of the unseeded path)."""
    it = iter(seeds)
    return mock.patch.object(SamplingParams, "resolve_seed", lambda self, _draws=None: self
                             if self.seed is not None else dataclasses.replace(self,
                                                                               seed=next(it)))


def first_two(eng, seed_base: int, seeded: bool = True) -> collections.Counter:
    """Counts of (x1, x2); also records how many drafts were proposed and accepted."""
    counts: collections.Counter = collections.Counter()
    stop = StopConditions(max_tokens=2)
    eng.drafted = eng.accepted = 0
    for b in range(0, REQUESTS, BATCH):
        seeds = [seed_base + b + i for i in range(BATCH)]
        params = [SamplingParams(temperature=1.0, seed=s if seeded else None) for s in seeds]
        with contextlib.nullcontext() if seeded else unseeded_drawing(seeds):
            result = run_to_completion(eng, [PROMPT] * BATCH, params, stop)
        counts.update(tuple(c.tokens) for c in result.completions)
        eng.drafted += sum(c.stats.draft_tokens for c in result.completions)
        eng.accepted += sum(c.stats.accepted_tokens for c in result.completions)
    return counts


def table(counts: collections.Counter) -> list[int]:
    return [counts[(a, b)] for a in range(VOCAB) for b in range(VOCAB)]


@pytest.fixture(scope="module")
def plain_counts(pair):
    target, _ = pair
    return first_two(engine(target, max_seqs=BATCH), seed_base=10_000_000)


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("sampled_drafts,top_k,groups", [(False, 4, 1), (True, 3, 1),
                                                         (True, 3, 2)])
def test_speculative_sampling_matches_plain(pair, plain_counts, sampled_drafts, top_k,
                                            groups, seeded) -> None:
    target, draft = pair
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=top_k,
                 sampled_drafts=sampled_drafts, groups=groups)
    spec = first_two(eng, seed_base=0, seeded=seeded)
    # x2 was decided by a verify round for every request, and drafts were really at stake:
    assert eng.drafted == 2 * REQUESTS
    assert 0.05 * eng.drafted < eng.accepted < 0.9 * eng.drafted
    assert chi_square_two_sample(table(spec), table(plain_counts)) > 1e-3


def test_broken_rule_is_detected(pair, plain_counts, monkeypatch) -> None:
    """The same comparison must reject a rule that accepts every draft."""
    target, draft = pair
    monkeypatch.setattr(acceptance, "draft_acceptance", lambda p, q, u: torch.ones_like(p,
                        dtype=torch.bool))
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True)
    spec = first_two(eng, seed_base=0, seeded=False)
    assert chi_square_two_sample(table(spec), table(plain_counts)) < 1e-6


def _accept_every_draft(probs, drafts, num_drafts, noise):
    choice = acceptance.sample(probs, noise)  # [B, K+1]
    return num_drafts, choice.gather(1, num_drafts[:, None]).squeeze(1)


def test_broken_coupled_rule_is_detected(pair, plain_counts, monkeypatch) -> None:
    target, draft = pair
    monkeypatch.setattr(verify_batch, "accept_coupled", _accept_every_draft)
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True)
    spec = first_two(eng, seed_base=0, seeded=True)
    assert chi_square_two_sample(table(spec), table(plain_counts)) < 1e-6



def later_pair(eng, seed_base: int, first: int, prompt: list[int]) -> collections.Counter:
    """Counts of generated tokens (x_first, x_first+1)."""
    counts: collections.Counter = collections.Counter()
    stop = StopConditions(max_tokens=first + 2)
    for b in range(0, REQUESTS, BATCH):
        params = [SamplingParams(temperature=1.0, seed=seed_base + b + i) for i in range(BATCH)]
        result = run_to_completion(eng, [prompt] * BATCH, params, stop)
        counts.update(tuple(c.tokens[first:first + 2]) for c in result.completions)
    return counts


def test_speculative_sampling_with_draft_ahead_matches_plain() -> None:
    """Tokens 4 and 5 follow the first verify round, so look-ahead drafts (sampled from
    their own top-k q) decide them on every hit. A 3-token vocabulary makes the bonus
    guess right often enough for the look-ahead to be really at stake."""
    vocab, prompt = 3, [1, 2, 0]
    target, draft = tied_pair(vocab=vocab, modules=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)
    plain = later_pair(engine(target, max_seqs=BATCH), 20_000_000, 4, prompt)
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=2, sampled_drafts=True,
                 draft_ahead=True)
    spec = later_pair(eng, 0, 4, prompt)
    assert eng.ahead_hits > 0.3 * REQUESTS, "look-ahead drafts were really at stake"

    def cells(counts):
        return [counts[(a, b)] for a in range(vocab) for b in range(vocab)]
    assert chi_square_two_sample(cells(spec), cells(plain)) > 1e-3

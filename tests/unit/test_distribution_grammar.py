"""Losslessness under a grammar, sampled: through the real verifier and drafter, the joint
distribution of the first three tokens under a regex is the same with and without
speculation, for seeded (coupled rule) and unseeded (Leviathan's) requests. The regex
makes each position's allowed tokens depend on the one before, so row 1 of a verify
window is right only if its mask has seen draft 1; a mask blind to it is caught."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
from unittest import mock

import pytest
import torch

from chainspec.engine import grammar as grammar_module
from chainspec.engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import engine, tied_pair
from tests.unit.stats import chi_square_two_sample

VOCAB = ["<eos>", "a", "b", "c", "d", "e", "f", "g"]
REGEX = "[ab][cd][ab][cd]([ab][cd])*"  # alternating classes; ends (EOS) after 4+ tokens
REQUESTS, BATCH = 3000, 100
PROMPT = [1, 5, 2]
CELLS = list(itertools.product([1, 2], [3, 4], [1, 2]))  # every (x1, x2, x3) it allows


def unseeded_drawing(seeds):
    """Requests sent without a seed draw theirs from `seeds` at admission (reproducible
    tests of the unseeded path)."""
    it = iter(seeds)
    return mock.patch.object(SamplingParams, "resolve_seed", lambda self, *_: self if
                             self.seed is not None else dataclasses.replace(self, seed=next(it)))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    target, draft = tied_pair(vocab=len(VOCAB), modules=2, seed=4)
    with torch.no_grad():  # soften both so that p and q overlap but differ
        target.lm_head.weight.mul_(0.15)
    return target, draft


@pytest.fixture(scope="module")
def grammar():
    return GrammarCompiler.for_vocab(VOCAB, [0]).compile(GrammarSpec(GrammarKind.REGEX, REGEX))


def first_three(eng, grammar, seed_base: int, seeded: bool = True) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    eng.drafted = eng.accepted = 0
    for b in range(0, REQUESTS, BATCH):
        seeds = [seed_base + b + i for i in range(BATCH)]
        params = [SamplingParams(temperature=1.0, seed=s if seeded else None, grammar=grammar)
                  for s in seeds]
        with contextlib.nullcontext() if seeded else unseeded_drawing(seeds):
            result = run_to_completion(eng, [PROMPT] * BATCH, params,
                                       StopConditions(max_tokens=3))
        counts.update(tuple(c.tokens) for c in result.completions)
        eng.drafted += sum(c.stats.draft_tokens for c in result.completions)
        eng.accepted += sum(c.stats.accepted_tokens for c in result.completions)
    return counts


def table(counts: collections.Counter) -> list[int]:
    assert set(counts) <= set(CELLS), set(counts) - set(CELLS)  # only what the regex allows
    return [counts[c] for c in CELLS]


@pytest.fixture(scope="module")
def plain_counts(pair, grammar):
    target, _ = pair
    counts = first_three(engine(target, max_seqs=BATCH, eos_ids=[0]), grammar, 10_000_000)
    assert min(table(counts)) > 100  # every allowed sequence is really drawn
    return counts


@pytest.mark.parametrize("seeded", [True, False])
def test_speculative_sampling_under_a_regex_matches_plain(pair, grammar, plain_counts,
                                                          seeded) -> None:
    target, draft = pair
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True,
                 eos_ids=[0])
    spec = first_three(eng, grammar, seed_base=0, seeded=seeded)
    # drafts were really at stake (the drafter knows no grammar: many are refused)
    assert 0.05 * eng.drafted < eng.accepted < 0.9 * eng.drafted
    assert chi_square_two_sample(table(spec), table(plain_counts)) > 1e-3


def test_a_mask_blind_to_draft_one_is_caught(pair, grammar, monkeypatch) -> None:
    """Row 1 masked as row 0: x3 is drawn from x2's classes, which the regex forbids."""
    def blind(self, drafts, bitmask):
        consumed = real(self, drafts, bitmask)
        bitmask[1:] = bitmask[0]
        return consumed
    real = grammar_module.GrammarMatcher.fill_window
    monkeypatch.setattr(grammar_module.GrammarMatcher, "fill_window", blind)
    target, draft = pair
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True,
                 eos_ids=[0])
    params = [SamplingParams(temperature=1.0, seed=i, grammar=grammar) for i in range(BATCH)]
    with pytest.raises(RuntimeError, match="grammar forbids"):
        run_to_completion(eng, [PROMPT] * BATCH, params, StopConditions(max_tokens=3))

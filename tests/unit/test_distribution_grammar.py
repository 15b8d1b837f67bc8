"""Losslessness under a grammar, sampled: through the real verifier and drafter, the joint
distribution of the first three tokens under a regex is the same with and without
speculation, for seeded (coupled rule) and unseeded (Leviathan's) requests.
- "alternating": each position's allowed tokens depend on the one before, so row 1 of a
  verify window is right only if its mask has seen draft 1 (a mask blind to it is
  caught), and many drafts are refused by the grammar (kept, and rejected with the
  residual: cutting them before verification fails this test);
- "forced": after the first token the grammar forces "cd", which is the token "cd" or
  "c" then "d": the drafter's draft is replaced by the forced token (a point mass in q)
  that the target accepts with p("cd")."""

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

VOCAB = ["<eos>", "a", "b", "c", "d", "cd", "e", "f"]
A, B, C, D, CD = 1, 2, 3, 4, 5
CASES = {  # name -> (regex, every (x1, x2, x3) it allows)
    "alternating": ("[ab][cd][ab][cd]([ab][cd])*",
                    list(itertools.product([A, B], [C, D], [A, B]))),
    "forced": ("[ab]cd[ab]cd", [(x, C, D) for x in (A, B)] +
               list(itertools.product([A, B], [CD], [A, B]))),
}
REQUESTS, BATCH = 3000, 100
PROMPT = [1, 5, 2]


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
def compiler():
    return GrammarCompiler.for_vocab(VOCAB, [0])


def grammar_of(compiler, case: str):
    return compiler.compile(GrammarSpec(GrammarKind.REGEX, CASES[case][0]))


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


def table(counts: collections.Counter, case: str) -> list[int]:
    cells = CASES[case][1]
    assert set(counts) <= set(cells), set(counts) - set(cells)  # only what the regex allows
    return [counts[c] for c in cells]


@pytest.fixture(scope="module")
def plain_counts(pair, compiler):
    target, _ = pair
    out = {}
    for case in CASES:
        counts = first_three(engine(target, max_seqs=BATCH, eos_ids=[0]),
                             grammar_of(compiler, case), 10_000_000)
        assert min(table(counts, case)) > 100  # every allowed sequence is really drawn
        out[case] = counts
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seeded", [True, False])
def test_speculative_sampling_under_a_regex_matches_plain(pair, compiler, plain_counts,
                                                          case, seeded, monkeypatch) -> None:
    forced = collections.Counter()
    real = grammar_module.GrammarMatcher.guide

    def counting(self, drafts):
        tokens, flags = real(self, drafts)
        forced.update(flags)
        return tokens, flags
    monkeypatch.setattr(grammar_module.GrammarMatcher, "guide", counting)
    target, draft = pair
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True,
                 eos_ids=[0])
    spec = first_three(eng, grammar_of(compiler, case), seed_base=0, seeded=seeded)
    # drafts were really at stake: accepted and rejected alike
    assert 0.05 * eng.drafted < eng.accepted < 0.9 * eng.drafted
    if case == "forced":  # one forced draft a round, in place of the drafter's
        assert forced[True] > REQUESTS and not forced[False]
    assert chi_square_two_sample(table(spec, case), table(plain_counts[case], case)) > 1e-3


def test_a_mask_blind_to_draft_one_is_caught(pair, compiler, monkeypatch) -> None:
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
    grammar = grammar_of(compiler, "alternating")
    params = [SamplingParams(temperature=1.0, seed=i, grammar=grammar) for i in range(BATCH)]
    with pytest.raises(RuntimeError, match="grammar forbids"):
        run_to_completion(eng, [PROMPT] * BATCH, params, StopConditions(max_tokens=3))


def test_cutting_refused_drafts_is_caught(pair, compiler, plain_counts, monkeypatch) -> None:
    """Dropping a draft because the grammar refuses it (instead of letting the verifier
    reject it) changes the distribution: the comparison above must see it."""
    real = grammar_module.GrammarMatcher.guide

    def cutting(self, drafts):
        tokens, flags = real(self, drafts)
        keep = len(tokens)
        probe = self._matcher.fork()  # xgrammar's copy of the committed state
        for i, tok in enumerate(tokens):
            if not probe.accept_token(tok):
                keep = i
                break
        return tokens[:keep], flags[:keep]
    monkeypatch.setattr(grammar_module.GrammarMatcher, "guide", cutting)
    target, draft = pair
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True,
                 eos_ids=[0])
    spec = first_three(eng, grammar_of(compiler, "alternating"), seed_base=0, seeded=False)
    assert chi_square_two_sample(table(spec, "alternating"),
                                 table(plain_counts["alternating"], "alternating")) < 1e-6

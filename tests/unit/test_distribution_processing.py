"""Sampled losslessness under logits processing: with a repetition penalty and min_p on,
the joint distribution of generated tokens (x2, x3) through the real verifier and drafter
(K = 2, top-k sampled drafts) matches the exact processed target distribution, computed
here by an independent per-prefix oracle. x3 is decided by row 1 of a verify window
whenever d1 was accepted, so the window-history rule is at stake; the same samples are
far from the unprocessed distribution, so processing is too."""

from __future__ import annotations

import collections

import pytest
import torch

from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.attention import DenseCausal
from tests.unit.engine_fixtures import engine, tied_pair
from tests.unit.stats import chi_square_vs_expected

VOCAB, REQUESTS, BATCH = 8, 3000, 100
PROMPT = [1, 5, 2]
REPETITION, MIN_P = 2.0, 0.3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    target, draft = tied_pair(vocab=VOCAB, modules=2, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.4)
    return target, draft


def next_probs(target, tokens: list[int], processed: bool) -> torch.Tensor:
    """Exact p(next | tokens) [V]: dense forward, then (independently of the engine)
    the repetition penalty over every seen token and min_p at temperature 1."""
    ids = torch.tensor(tokens)
    with torch.no_grad():
        hidden = target(ids, torch.arange(len(tokens)),
                        DenseCausal(1, len(tokens), target.attention_scale))
        logits = target.logits(hidden[-1:])[0].double()
    if not processed:
        return logits.softmax(-1)
    for t in set(tokens):
        logits[t] = logits[t] / REPETITION if logits[t] > 0 else logits[t] * REPETITION
    p = logits.softmax(-1)
    p = torch.where(p >= MIN_P * p.max(), p, torch.zeros_like(p))
    return p / p.sum()


def exact_pair(target, processed: bool) -> torch.Tensor:
    """P(x2, x3) [V, V], summed over x1."""
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = next_probs(target, PROMPT, processed)
    for a in range(VOCAB):
        if p1[a] == 0:
            continue
        p2 = next_probs(target, PROMPT + [a], processed)
        for b in range(VOCAB):
            if p2[b] > 0:
                joint[b] += p1[a] * p2[b] * next_probs(target, PROMPT + [a, b], processed)
    return joint


def test_sampled_with_repetition_penalty_and_min_p(pair) -> None:
    target, draft = pair
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True)
    counts: collections.Counter = collections.Counter()
    drafted = accepted = 0
    for b in range(0, REQUESTS, BATCH):
        params = [SamplingParams(temperature=1.0, seed=b + i, repetition_penalty=REPETITION,
                                 min_p=MIN_P) for i in range(BATCH)]
        result = run_to_completion(eng, [PROMPT] * BATCH, params, StopConditions(max_tokens=3))
        counts.update(tuple(c.tokens[1:3]) for c in result.completions)
        drafted += sum(c.stats.draft_tokens for c in result.completions)
        accepted += sum(c.stats.accepted_tokens for c in result.completions)
    table = [counts[(a, b)] for a in range(VOCAB) for b in range(VOCAB)]
    assert 0.1 * drafted < accepted < 0.9 * drafted  # drafts were really at stake
    processed, raw = exact_pair(target, True), exact_pair(target, False)
    assert (processed == 0).sum() > (raw == 0).sum()  # min_p removed outcomes
    assert chi_square_vs_expected(table, processed.numpy()) > 1e-3
    assert chi_square_vs_expected(table, raw.numpy()) < 1e-6  # processing was at stake

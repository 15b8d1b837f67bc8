"""Logits processors over verify windows: hand-checked values per processor, the
history-within-window rule (row r sees drafts d_1..d_r; an off-by-one fails), agreement
with a per-row loop reference, min-p, logprobs and parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from chainspec.engine.logits_processors import (
    LogitsProcessing,
    WindowRequest,
    apply_min_tokens,
    apply_penalties,
    window_counts,
)
from chainspec.engine.logprobs import host_logprobs, window_logprobs
from chainspec.engine.sampling import SamplingParams, target_probs


def test_window_counts_row_r_sees_drafts_before_it() -> None:
    counts = torch.zeros(1, 5)
    counts[0, 1] = 1.0  # one committed generated token: 1
    drafts = torch.tensor([[2, 2, 4]])
    rows = window_counts(counts, drafts, torch.tensor([2]))  # d3 = 4 is padding
    assert rows[0, :, 1].tolist() == [1, 1, 1, 1]
    assert rows[0, :, 2].tolist() == [0, 1, 2, 2]  # d1 enters at row 1, d2 at row 2
    assert rows[0, :, 4].tolist() == [0, 0, 0, 0]  # padding drafts never count


def test_penalties_by_hand() -> None:
    logits = torch.tensor([[[2.0, -1.0, 0.5, 3.0]]])
    counts = torch.tensor([[[0.0, 1.0, 2.0, 0.0]]])
    out = apply_penalties(logits, counts, None, torch.tensor([0.5]), torch.tensor([0.25]),
                          torch.tensor([1.0]))
    assert out[0, 0].tolist() == [2.0, -1.75, -0.5, 3.0]
    seen_prompt = torch.tensor([[False, False, False, True]])
    out = apply_penalties(logits, counts, seen_prompt, torch.zeros(1), torch.zeros(1),
                          torch.tensor([2.0]))
    # seen (prompt or generated): positive logits halved, negative doubled; 0 untouched
    assert out[0, 0].tolist() == [2.0, -2.0, 0.25, 1.5]


def test_min_tokens_counts_drafts_before_the_row() -> None:
    logits = torch.zeros(1, 4, 3)
    stop = torch.tensor([[False, True, False]])
    out = apply_min_tokens(logits, stop, torch.tensor([1]), torch.tensor([3]))
    # row r decides generated token number 1 + r: numbers 1, 2 are below min_tokens 3
    assert [math.isinf(x) for x in out[0, :, 1].tolist()] == [True, True, False, False]
    assert out[0, :, 0].tolist() == [0.0] * 4


def _reference(logits, reqs, drafts, num_drafts, shift=0):
    """Per-row loop: row r's history is generated + d_1..d_{r+shift} (shift 0 is right)."""
    out = logits.clone()
    for b, req in enumerate(reqs):
        p = req.params
        for r in range(logits.shape[1]):
            hist = list(req.generated) + drafts[b, :min(r + shift, num_drafts[b])].tolist()
            row = out[b, r]
            for t, bias in p.logit_bias:
                row[t] += bias
            if len(hist) < p.min_tokens:
                row[list(req.stop_ids)] = -math.inf
            for t in set(hist) | set(req.prompt):
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else \
                    row[t] * p.repetition_penalty
            for t in set(hist):
                row[t] -= p.frequency_penalty * hist.count(t) + p.presence_penalty
    return out


def _batch(v: int = 11):
    gen = torch.Generator().manual_seed(3)
    reqs = [WindowRequest(SamplingParams(presence_penalty=0.7, frequency_penalty=0.3,
                                         repetition_penalty=1.6, logit_bias={3: 2.5, 9: -4}),
                          [1, 2, 3], [4, 4, 5]),
            WindowRequest(SamplingParams(min_tokens=4, repetition_penalty=0.8), [7], [6],
                          frozenset({0, 8})),
            WindowRequest(SamplingParams(), [2, 2], [])]
    logits = torch.randn(3, 4, v, generator=gen) * 3
    drafts = torch.tensor([[4, 6, 4], [8, 0, 6], [1, 1, 1]])
    return reqs, logits, drafts, torch.tensor([3, 2, 0])


def test_processing_matches_per_row_reference_and_catches_off_by_one() -> None:
    reqs, logits, drafts, num = _batch()
    proc = LogitsProcessing.build(reqs, logits.shape[-1], "cpu")
    real = torch.arange(4)[None, :] <= num[:, None]  # rows past num_drafts: padding
    out = proc.apply(logits, drafts, num)[real]
    assert torch.allclose(out, _reference(logits, reqs, drafts, num)[real], atol=1e-5)
    for shift in (-1, 1):  # row r seeing d_1..d_{r-1} or d_1..d_{r+1}
        wrong = _reference(logits, reqs, drafts, num, shift=shift)[real]
        assert not torch.allclose(out, wrong, atol=1e-3)
    out = proc.apply(logits, drafts, num)
    assert torch.equal(out[2], logits[2])  # a request without processing is untouched


def test_no_processing_builds_nothing() -> None:
    reqs = [WindowRequest(SamplingParams(temperature=0.7, min_p=0.2), [1], [2])]
    assert LogitsProcessing.build(reqs, 8, "cpu") is None


def test_min_p_by_hand() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = target_probs(probs.log(), torch.ones(1), torch.zeros(1, dtype=torch.long),
                       torch.ones(1), torch.tensor([0.2]))  # floor 0.2 * 0.5 = 0.1
    assert torch.allclose(out, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    # after temperature: T = 2 flattens p to ~[.41, .32, .22, .13]: all above 0.2 * max
    out = target_probs(probs.log(), torch.full((1,), 2.0), torch.zeros(1, dtype=torch.long),
                       torch.ones(1), torch.tensor([0.2]))
    assert (out > 0).all()


def test_window_logprobs_by_hand() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [0.6, 0.3, 0.1]]]))
    window = window_logprobs(logits, torch.tensor([[0, 1]]), torch.tensor([1]),
                             torch.tensor([2]), top_n=2)
    got = host_logprobs(window, 0, [0, 2], 2)
    assert [t.token for t in got] == [0, 2]  # d1 accepted at row 0, next token at row 1
    assert got[0].logprob == pytest.approx(math.log(0.5))
    assert got[1].logprob == pytest.approx(math.log(0.7))
    assert [t for t, _ in got[1].top] == [2, 1]
    assert got[1].top[1][1] == pytest.approx(math.log(0.2))
    assert host_logprobs(window, 0, [0, 2], 0)[0].top == ()


@pytest.mark.parametrize("kwargs,name", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {3: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"num_logprobs": 21}, "num_logprobs"),
])
def test_params_are_validated(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_logit_bias_mapping_is_stored_as_sorted_pairs() -> None:
    p = SamplingParams(logit_bias={9: -1, 2: 3})
    assert p.logit_bias == ((2, 3.0), (9, -1.0)) and p.processes_logits
    assert not SamplingParams(min_p=0.5, num_logprobs=3).processes_logits

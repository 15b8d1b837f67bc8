"""Sampling: params, target probabilities (hand-checked), noise, race, draft top-k."""

from __future__ import annotations

import math

import pytest
import torch

from chainspec.engine.sampling import (
    NoiseStream,
    SamplingBatch,
    SamplingParams,
    draft_topk,
    exponential_noise,
    exponential_noise_at,
    sample,
    target_probs,
    uniform,
)
from tests.unit.stats import chi_square_vs_expected

P4 = [0.1, 0.2, 0.3, 0.4]
LOG_P4 = torch.tensor(P4).log()


def probs_of(logits, temperature=1.0, top_k=0, top_p=1.0):
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)])
    return batch.target_probs(torch.as_tensor(logits, dtype=torch.float32)[None])[0]


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32),
                               atol=1e-6, rtol=1e-5)


# --- SamplingParams -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"seed": True}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": -(2 ** 63) - 1}, "seed"),
])
def test_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_params_accept_edges_and_resolve_seed():
    for kwargs in ({"temperature": 0}, {"top_k": -1}, {"top_k": 0}, {"top_p": 1},
                   {"seed": 2 ** 64 - 1}, {"seed": -(2 ** 63)}):
        SamplingParams(**kwargs)
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(seed=7).resolve_seed().seed == 7
    assert isinstance(SamplingParams().resolve_seed().seed, int)


def test_batch_tensors():
    batch = SamplingBatch.from_params([
        SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, seed=2 ** 64 - 1),
        SamplingParams(temperature=0, top_k=3, seed=5)])
    close(batch.temperature, [0.5, 0.0])
    assert batch.top_k.tolist() == [0, 3]
    close(batch.top_p, [0.9, 1.0])
    assert batch.seed.tolist() == [-1, 5]  # 2**64 - 1 as two's complement


# --- target probabilities -------------------------------------------------------------

def test_temperature_one_and_two():
    logits = [0.0, math.log(2), math.log(4)]
    close(probs_of(logits), [1 / 7, 2 / 7, 4 / 7])
    r2 = math.sqrt(2)
    close(probs_of(logits, temperature=2.0), [1 / (3 + r2), r2 / (3 + r2), 2 / (3 + r2)])


def test_top_k_keeps_k_largest_renormalized():
    close(probs_of(LOG_P4, top_k=2), [0, 0, 3 / 7, 4 / 7])
    close(probs_of(LOG_P4, top_k=10), P4)  # k > V: everything


@pytest.mark.parametrize("top_p, expected", [
    (0.35, [0, 0, 0, 1]),  # 0.4 alone already covers 0.35
    (0.65, [0, 0, 3 / 7, 4 / 7]),  # 0.4 < 0.65 <= 0.7
    (0.75, [0, 2 / 9, 3 / 9, 4 / 9]),
    (1.0, P4),
])
def test_top_p_smallest_set_reaching_p(top_p, expected):
    close(probs_of(LOG_P4, top_p=top_p), expected)


def test_top_p_applies_after_top_k_renormalization():
    # top-k 2 -> (3/7, 4/7); 4/7 > 0.5 so top-p 0.5 keeps one token. On the raw
    # distribution top-p 0.5 would keep two (0.4 < 0.5).
    close(probs_of(LOG_P4, top_k=2, top_p=0.5), [0, 0, 0, 1])
    close(probs_of(LOG_P4, top_p=0.5), [0, 0, 3 / 7, 4 / 7])


def test_greedy_rows_are_one_hot_first_max():
    close(probs_of([0.3, 2.0, 2.0, -1.0], temperature=0), [0, 1, 0, 0])
    close(probs_of([0.3, 2.0, 2.0, -1.0], temperature=0, top_k=1, top_p=0.1), [0, 1, 0, 0])


def test_rows_are_independent_in_one_batch():
    params = [SamplingParams(temperature=0), SamplingParams(top_k=2),
              SamplingParams(temperature=2.0, top_p=0.75), SamplingParams()]
    logits = torch.randn(4, 3, 11, generator=torch.Generator().manual_seed(0))
    together = SamplingBatch.from_params(params).target_probs(logits)
    for i, p in enumerate(params):
        alone = SamplingBatch.from_params([p]).target_probs(logits[i:i + 1])
        torch.testing.assert_close(together[i:i + 1], alone)
    torch.testing.assert_close(together.sum(-1), torch.ones(4, 3))


def test_masked_vocab_stays_zero():
    p = probs_of([0.0, -math.inf, 1.0, -math.inf], top_p=0.99)
    assert p[1] == 0 and p[3] == 0
    close(p.sum(), 1.0)


def test_functional_form_matches_batch_form():
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(1))
    t, k, p = torch.tensor([0.0, 0.7, 1.3]), torch.tensor([0, 4, 0]), torch.tensor([1, 1, .6])
    batch = SamplingBatch(t, k, p, torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(target_probs(logits, t, k, p), batch.target_probs(logits))


# --- noise and the race ---------------------------------------------------------------

def test_noise_ranges_and_stream_independence():
    seeds = torch.arange(64)[:, None]
    u = uniform(seeds, NoiseStream.SAMPLE, torch.tensor(3), 256)  # [64, 256]
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=32, min=0, max=1)
    assert chi_square_vs_expected(counts.numpy(), [1 / 32] * 32) > 1e-3
    other = uniform(seeds, NoiseStream.ACCEPT, torch.tensor(3), 256)
    assert abs(torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1]) < 0.02
    e = exponential_noise(seeds, NoiseStream.RESIDUAL, torch.tensor(3), 256)
    assert e.min() > 0 and abs(e.mean().item() - 1) < 0.03


def test_noise_is_a_function_of_seed_stream_position_index():
    a = uniform(torch.tensor([5, 9, 5]), 0, torch.tensor([2, 2, 3]), 8)
    assert torch.equal(a, uniform(torch.tensor([5, 9, 5]), 0, torch.tensor([2, 2, 3]), 8))
    assert torch.equal(a[0], uniform(torch.tensor([5]), 0, torch.tensor([2]), 8)[0])
    assert torch.equal(a[0, :4], uniform(torch.tensor(5), 0, torch.tensor(2), 4))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert not torch.equal(a, uniform(torch.tensor([5, 9, 5]), 1, torch.tensor([2, 2, 3]), 8))
    hi = uniform(torch.tensor([5 + 2 ** 40]), 0, torch.tensor([2]), 8)
    assert not torch.equal(a[0], hi[0])  # the seed's upper 32 bits matter


def test_noise_read_at_indices_equals_the_full_width_noise():
    seed, pos = torch.tensor([5, -9, 2 ** 40]), torch.tensor([2, 7, 3])
    index = torch.tensor([[0, 63, 5], [17, 17, 1], [62, 2, 40]])
    full = exponential_noise(seed, NoiseStream.SAMPLE, pos, 64)  # [3, 64]
    assert torch.equal(exponential_noise_at(seed, NoiseStream.SAMPLE, pos, index),
                       full.gather(1, index))


def test_same_seed_same_tokens_regardless_of_batch():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12, 13, 14, 15)]
    batch = SamplingBatch.from_params(params)
    pos = torch.tensor([7, 7, 3, 9, 7])

    def tokens(rows):
        b = SamplingBatch.from_params([params[i] for i in rows])
        noise = exponential_noise(b.seed, NoiseStream.SAMPLE, pos[rows], 50)
        return sample(b.target_probs(logits[rows]), noise)

    full = tokens([0, 1, 2, 3, 4])
    assert torch.equal(tokens([3, 1]), full[[3, 1]])
    assert torch.equal(tokens([2]), full[[2]])
    assert batch.seed.tolist() == [11, 12, 13, 14, 15]


def test_sample_picks_hot_index_and_never_zero_weight():
    noise = exponential_noise(torch.arange(100), 0, torch.tensor(0), 5)
    hot = torch.zeros(100, 5)
    hot[:, 3] = 1.0
    assert (sample(hot, noise) == 3).all()
    w = torch.tensor([0.0, 2.0, 0.0, 6.0, 0.0]).expand(100, 5)  # unnormalized is fine
    assert set(sample(w, noise).tolist()) == {1, 3}


def test_sample_frequencies_match_probs():
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    n = 20_000
    noise = exponential_noise(torch.arange(n), NoiseStream.SAMPLE, torch.tensor(1), 4)
    tokens = sample(probs.expand(n, 4), noise)
    counts = torch.bincount(tokens, minlength=4).numpy()
    assert chi_square_vs_expected(counts, probs.numpy()) > 1e-3
    assert chi_square_vs_expected(counts, [0.1, 0.1, 0.3, 0.5]) < 1e-6  # the check has power


# --- draft distributions --------------------------------------------------------------

def test_draft_topk_support_and_renormalized_probs():
    logits = torch.tensor([[math.log(x) for x in (0.1, 0.4, 0.2, 0.3)]] * 2)
    pos = torch.tensor([5, 5])
    token, support, probs = draft_topk(logits, torch.tensor([1.0, 0.0]), torch.tensor([3, 3]),
                                       pos, 2)
    assert support.tolist() == [[1, 3], [1, 3]]
    close(probs[0], [4 / 7, 3 / 7])
    close(probs[1], [1.0, 0.0])  # greedy row: point mass on the top token
    picks = {tuple(draft_topk(logits, torch.tensor([1.0, 0.0]), torch.tensor([s, s]), pos,
                              2)[0].tolist()) for s in range(40)}
    assert picks == {(1, 1), (3, 1)}  # noise steers the sampled row, never the greedy one


def test_draft_is_the_targets_race_over_the_truncated_q():
    """The coupling: the draft is argmax(q / E) over the whole vocabulary with the very
    noise the target races with at that position (q zero off the top-k support)."""
    v, n = 50, 256
    logits = torch.randn(n, v, generator=torch.Generator().manual_seed(0))
    seed, pos = torch.arange(n) * 7919 - 100, torch.arange(n) % 13 + 1
    token, support, probs = draft_topk(logits, torch.full((n,), 0.8), seed, pos, 8)
    q = torch.zeros(n, v).scatter(1, support, probs)  # [n, V]
    race = sample(q, exponential_noise(seed, NoiseStream.SAMPLE, pos, v))
    assert torch.equal(token, race)
    assert len(set(token.tolist())) > 20  # really sampled


def test_draft_topk_temperature_and_frequencies():
    logits = torch.tensor([0.0, math.log(2), math.log(4), -5.0])
    n = 20_000
    token, support, probs = draft_topk(logits.expand(n, 4), torch.full((n,), 2.0),
                                       torch.arange(n), torch.tensor(4), 3)
    r2 = math.sqrt(2)
    close(probs[0], [2 / (3 + r2), r2 / (3 + r2), 1 / (3 + r2)])
    assert support[0].tolist() == [2, 1, 0]
    counts = torch.bincount(token, minlength=4).numpy()
    assert counts[3] == 0
    assert chi_square_vs_expected(counts[:3], [1 / (3 + r2), r2 / (3 + r2), 2 / (3 + r2)]) > 1e-3

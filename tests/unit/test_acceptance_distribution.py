"""Losslessness of the sampled acceptance rule, statistically, at the rule level.

A two-step target over V = 6 tokens: p1(x1) and p2(x2 | x1); a draft model q1, q2(. | x1)
that disagrees with it. Many sequences (one seed each, one batch) run speculative rounds
with K = 2 drafts exactly as the verifier would -- drafter noise, acceptance uniforms and
the residual/bonus race all keyed per DESIGN 3.3 -- until two tokens are committed. The
joint histogram of (x1, x2) must fit p1(x1) p2(x2 | x1) (chi-square), and a deliberately
broken rule must fail the same check by a wide margin (the test has power).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from chainspec.engine import acceptance
from chainspec.engine.acceptance import accept_sampled, round_noise
from chainspec.engine.sampling import draft_topk
from tests.unit.stats import chi_square_two_sample, chi_square_vs_expected

V, K, TOP_K, N = 6, 2, 3, 60_000
PASS, DETECT = 1e-3, 1e-6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Small elementwise ops: intra-op threads only add contention (10x slower on a busy box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _dirichlet(gen: torch.Generator, *shape: int) -> torch.Tensor:
    e = -torch.rand(*shape, V, generator=gen, dtype=torch.float64).log()
    return (e / e.sum(-1, keepdim=True)).float()


GEN = torch.Generator().manual_seed(2024)
P1, P2 = _dirichlet(GEN), _dirichlet(GEN, V)  # [V], [V, V]: row x1 is p2(. | x1)
Q1, Q2 = _dirichlet(GEN), _dirichlet(GEN, V)
EXACT = (P1[:, None] * P2).double().numpy()  # [V, V] joint of (x1, x2)


def _draft(mode: str, q: torch.Tensor, seed: torch.Tensor, pos: int):
    """Draft at position `pos` from q [N, V] -> token [N], support, probs as sent."""
    k = V if mode == "point_mass" else TOP_K
    token, support, probs = draft_topk(q.log(), torch.ones(len(seed)), seed, torch.tensor(pos),
                                       k)
    if mode == "point_mass":  # drafts sampled from q, verified as point masses
        return token, None, None
    if mode == "unnormalized_q":  # bug: q over the top-k support before renormalizing
        probs = q.gather(1, support)
    return token, support, probs


def _round(mode, seed, first_pos, rows, drafts):
    """One verify round; rows [N, K+1, V], drafts list of (token, support, probs)."""
    tokens = torch.stack([d[0] for d in drafts], 1)
    support = None if drafts[0][1] is None else torch.stack([d[1] for d in drafts], 1)
    probs = None if drafts[0][2] is None else torch.stack([d[2] for d in drafts], 1)
    u, noise = round_noise(seed, torch.full_like(seed, first_pos), len(drafts), V)
    num = torch.full_like(seed, len(drafts))
    return accept_sampled(rows, tokens, support, probs, num, u, noise)


def speculative_pairs(mode: str, base_seed: int, n: int = N) -> torch.Tensor:
    """Commit x1, x2 (positions 1, 2) for n sequences -> [n, 2]. x[0] is the prompt."""
    seed = base_seed + torch.arange(n)
    d1 = _draft(mode, Q1.expand(n, V), seed, 1)
    d2 = _draft(mode, Q2[d1[0]], seed, 2)
    rows = torch.stack([P1.expand(n, V), P2[d1[0]], P2[d2[0]]], 1)  # [n, 3, V]
    j, nxt = _round(mode, seed, 1, rows, [d1, d2])
    x1 = torch.where(j >= 1, d1[0], nxt)
    # Sequences that rejected draft 1 committed x1 only: a second round from position 2.
    # NOTE: it redrafts position 2 with the same SAMPLE key as round 1's unused d2.
    e1 = _draft(mode, Q2[x1], seed, 2)
    rows2 = torch.stack([P2[x1], P2[e1[0]]], 1)  # [n, 2, V]
    j2, nxt2 = _round(mode, seed, 2, rows2, [e1])
    x2_round2 = torch.where(j2 >= 1, e1[0], nxt2)
    x2 = torch.where(j >= 2, d2[0], torch.where(j == 1, nxt, x2_round2))
    return torch.stack([x1, x2], 1)


def plain_pairs(base_seed: int, n: int = N) -> torch.Tensor:
    """Non-speculative sampling of x1, x2 with the same seeds (a round with no drafts)."""
    seed = base_seed + torch.arange(n)
    none = torch.zeros(n, 0, dtype=torch.long)
    zero = torch.zeros(n, dtype=torch.long)

    def step(p, pos):
        u, noise = round_noise(seed, torch.full_like(seed, pos), 0, V)
        return accept_sampled(p[:, None], none, None, None, zero, u, noise)[1]

    x1 = step(P1.expand(n, V), 1)
    return torch.stack([x1, step(P2[x1], 2)], 1)


def joint_counts(pairs: torch.Tensor) -> np.ndarray:
    return torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V).numpy()


def test_draft_model_disagrees_with_target():
    # Guards against a vacuous test: q far from p means many rejections and residual draws.
    assert (Q1 - P1).abs().sum() > 0.5 and (Q2 - P2).abs().sum(-1).min() > 0.3


@pytest.mark.parametrize("mode", ["point_mass", "top_k"])
def test_speculative_output_matches_target_joint(mode):
    pvalue = chi_square_vs_expected(joint_counts(speculative_pairs(mode, 0)), EXACT)
    assert pvalue > PASS, f"{mode}: p = {pvalue:.3g}"


def test_plain_sampling_matches_target_joint_and_speculative_sample():
    plain = joint_counts(plain_pairs(10 ** 6))
    assert chi_square_vs_expected(plain, EXACT) > PASS
    spec = joint_counts(speculative_pairs("top_k", 2 * 10 ** 6))
    assert chi_square_two_sample(plain, spec) > PASS


def _always_accept(p_d, q_d, u):
    return torch.ones_like(p_d, dtype=torch.bool)


def _residual_is_p(p, q):
    return p


def _noise_ignores_position(seed, first_pos, num_slots, vocab_size):
    # RNG bug: every round of a request reuses the same noise.
    return acceptance.round_noise(seed, torch.zeros_like(first_pos), num_slots, vocab_size)


@pytest.mark.parametrize("mode, broken", [
    ("top_k", "always_accept"),
    ("top_k", "residual_is_p"),
    ("point_mass", "residual_is_p"),
    ("top_k", "noise_ignores_position"),
    ("unnormalized_q", None),
])
def test_broken_rule_is_detected(monkeypatch, mode, broken):
    if broken == "always_accept":
        monkeypatch.setattr(acceptance, "draft_acceptance", _always_accept)
    elif broken == "residual_is_p":
        monkeypatch.setattr(acceptance, "residual", _residual_is_p)
    elif broken == "noise_ignores_position":
        monkeypatch.setattr(sys.modules[__name__], "round_noise", _noise_ignores_position)
    counts = joint_counts(speculative_pairs(mode, 0))
    pvalue = chi_square_vs_expected(counts, EXACT)
    assert pvalue < DETECT, f"{mode}/{broken}: p = {pvalue:.3g}"
    assert chi_square_two_sample(counts, joint_counts(plain_pairs(10 ** 6))) < DETECT


def test_chi_square_helpers():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    assert chi_square_vs_expected([500, 300, 200, 0], probs) > 0.99
    assert chi_square_vs_expected([500, 300, 199, 1], probs) == 0.0  # impossible outcome
    assert chi_square_vs_expected([600, 300, 100, 0], probs) < 1e-6
    # cells with tiny expectation are pooled rather than inflating the statistic
    tiny = [0.4, 0.4, 0.1996, 0.0002, 0.0002]  # expected 2 and 2 of 10_000
    assert chi_square_vs_expected([4000, 4000, 1990, 10, 0], tiny) > 0.5
    assert chi_square_two_sample([50, 30, 20], [500, 300, 200]) > 0.99
    assert chi_square_two_sample([80, 10, 10], [500, 300, 200]) < 1e-6

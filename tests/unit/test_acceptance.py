"""Acceptance rules on tiny vocabularies with numbers checkable by hand (V = 4)."""

from __future__ import annotations

import numpy as np
import torch

from chainspec.engine.acceptance import (
    accept_coupled,
    accept_greedy,
    accept_sampled,
    coupled_noise,
    next_token_distribution,
    residual,
    round_noise,
)
from chainspec.engine.sampling import (
    NoiseStream,
    SamplingBatch,
    SamplingParams,
    exponential_noise,
    sample,
    uniform,
)

P = [0.1, 0.2, 0.3, 0.4]
FLAT = [0.25, 0.25, 0.25, 0.25]
ROW2 = [0.7, 0.1, 0.1, 0.1]


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(actual, expected):
    torch.testing.assert_close(actual, t(expected), atol=1e-6, rtol=1e-5)


def decide(rows, drafts, u, num=None, support=None, probs=None):
    """One sequence: rows [K+1][V], drafts [K], u [K] -> (accepted_len, next dist [V])."""
    num = len(drafts) if num is None else num
    n, dist = next_token_distribution(
        t([rows]), t([drafts], torch.long),
        None if support is None else t([support], torch.long),
        None if probs is None else t([probs]), t([num], torch.long), t([u]))
    return int(n[0]), dist[0]


# --- greedy ---------------------------------------------------------------------------

def test_greedy_accepts_while_draft_equals_argmax():
    top = t([[2, 1, 3]] * 5, torch.long)  # argmax of rows 0, 1, 2
    drafts = t([[2, 1], [2, 0], [0, 1], [2, 1], [-1, 99]], torch.long)
    num = t([2, 2, 2, 1, 0], torch.long)  # row 3 stops after one draft, row 4 has none
    n, bonus = accept_greedy(top, drafts, num)
    assert n.tolist() == [2, 1, 0, 1, 0]
    assert bonus.tolist() == [3, 1, 2, 1, 2]


def test_greedy_from_logits_equals_from_argmax():
    logits = torch.randn(6, 4, 5, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1)
    drafts = top[:, :3].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % 5
    drafts[2, 2] = (drafts[2, 2] + 1) % 5
    num = t([3, 3, 3, 2, 0, 1], torch.long)
    n, bonus = accept_greedy(logits, drafts, num)
    assert n.tolist() == [3, 0, 2, 2, 0, 1]
    assert torch.equal(bonus, top.gather(1, n[:, None]).squeeze(1))
    assert all(torch.equal(a, b) for a, b in zip((n, bonus), accept_greedy(top, drafts, num),
                                                 strict=True))


# --- sampled: point-mass q ------------------------------------------------------------

def test_point_mass_accepts_with_probability_p_of_draft():
    assert decide([P, FLAT], [1], [0.19])[0] == 1  # u < p(1) = 0.2
    n, dist = decide([P, FLAT], [1], [0.21])
    assert n == 0
    close(dist, [1 / 8, 0, 3 / 8, 4 / 8])  # normalize(max(p - e_1, 0)) = (.1, 0, .3, .4)/.8


def test_bonus_after_full_acceptance_is_p_of_last_row():
    n, dist = decide([P, FLAT, ROW2], [3, 0], [0.39, 0.24])  # 0.39 < 0.4, 0.24 < 0.25
    assert n == 2
    close(dist, ROW2)


def test_zero_target_probability_is_never_accepted():
    n, dist = decide([[0.5, 0, 0.5, 0], FLAT], [1], [1e-7])
    assert n == 0
    close(dist, [0.5, 0, 0.5, 0])  # max(p - e_1, 0) = p


def test_rejection_at_second_draft_uses_second_rows_p_and_q():
    # draft 0 = 3 accepted (0.3 < 0.4); draft 1 = 0 at row 1: p = ROW2, u = 0.75 > 0.7.
    n, dist = decide([P, ROW2, FLAT], [3, 0], [0.3, 0.75])
    assert n == 1
    close(dist, [0, 1 / 3, 1 / 3, 1 / 3])  # max(ROW2 - e_0, 0) = (0, .1, .1, .1)


# --- sampled: top-k q -----------------------------------------------------------------

SUP = [[1, 2]]
Q = [[0.5, 0.5]]


def test_top_k_q_ratio_and_residual():
    # d = 1: p/q = 0.2/0.5 = 0.4
    assert decide([P, FLAT], [1], [0.39], support=SUP, probs=Q)[0] == 1
    n, dist = decide([P, FLAT], [1], [0.41], support=SUP, probs=Q)
    assert n == 0
    close(dist, [0.2, 0, 0, 0.8])  # max(p - (0, .5, .5, 0), 0) = (.1, 0, 0, .4)
    # d = 2: p/q = 0.3/0.5 = 0.6, same residual
    assert decide([P, FLAT], [2], [0.59], support=SUP, probs=Q)[0] == 1
    n, dist = decide([P, FLAT], [2], [0.61], support=SUP, probs=Q)
    assert n == 0
    close(dist, [0.2, 0, 0, 0.8])


def test_p_at_least_q_is_always_accepted():
    n, _ = decide([P, FLAT], [3], [0.99999], support=[[3, 0]], probs=[[0.3, 0.7]])
    assert n == 1  # p(3) = 0.4 >= q(3) = 0.3


def test_top_k_q_of_the_rejected_draft_is_used():
    sup, q = [[3, 0], [0, 1]], [[0.6, 0.4], [0.8, 0.2]]
    # draft 0 = 3: ratio .4/.6 -> accept at u = .5; draft 1 = 0: ratio .7/.8 -> reject at .9
    n, dist = decide([P, ROW2, FLAT], [3, 0], [0.5, 0.9], support=sup, probs=q)
    assert n == 1
    close(dist, [0, 0, 0.5, 0.5])  # max(ROW2 - (.8, .2, 0, 0), 0) = (0, 0, .1, .1)


def test_draft_outside_its_support_ends_the_drafts():
    n, dist = decide([P, ROW2, FLAT], [3, 2], [0.1, 0.1], support=[[3, 0], [0, 1]],
                     probs=[[0.6, 0.4], [0.8, 0.2]])
    assert n == 1
    close(dist, ROW2)  # no decision at row 1: plain sample from p


# --- num_drafts, padding, shapes ------------------------------------------------------

def test_num_drafts_limits_and_padding_is_ignored():
    n, dist = decide([P, ROW2, FLAT, FLAT], [3, -5, 99], [0.1, 0.1, 0.1], num=1)
    assert n == 1
    close(dist, ROW2)  # bonus from row num_drafts, not row K
    n, dist = decide([P, ROW2, FLAT, FLAT], [-1, -1, -1], [0.0, 0.0, 0.0], num=0,
                     support=[[7, -3]] * 3, probs=[[1.0, 0.0]] * 3)
    assert n == 0
    close(dist, P)  # no drafts: plain sampling from row 0


def test_no_draft_slots_at_all():
    n, dist = next_token_distribution(t([[P]]), torch.zeros(1, 0, dtype=torch.long), None,
                                      None, t([0], torch.long), torch.zeros(1, 0))
    assert n.tolist() == [0]
    close(dist[0], P)


def test_batch_rows_decide_independently():
    cases = [([P, FLAT], [1], [0.21], 1), ([P, FLAT], [3], [0.39], 1),
             ([P, FLAT], [2], [0.5], 0), ([ROW2, P], [0], [0.69], 1)]
    n, dist = next_token_distribution(
        t([c[0] for c in cases]), t([c[1] for c in cases], torch.long), None, None,
        t([c[3] for c in cases], torch.long), t([c[2] for c in cases]))
    for i, c in enumerate(cases):
        n1, d1 = decide(c[0], c[1], c[2], num=c[3])
        assert int(n[i]) == n1
        torch.testing.assert_close(dist[i], d1)
    assert n.tolist() == [0, 1, 0, 1]


# --- residual and the final race ------------------------------------------------------

def test_residual_by_hand_and_fallback():
    close(residual(t([P]), t([[0.0, 0.5, 0.5, 0.0]]))[0], [0.2, 0, 0, 0.8])
    close(residual(t([P]), t([P]))[0], P)  # p == q: nothing left, fall back to p
    close(residual(t([P]), t([[0.0, 0.0, 0.0, 0.0]]))[0], P)


def test_next_token_follows_the_race_over_the_distribution():
    rows = t([[P, FLAT]] * 3)
    drafts = t([[1]] * 3, torch.long)
    u = t([[0.21]] * 3)  # all reject: residual (1/8, 0, 3/8, 1/2)
    noise = t([[1, 1, 1, 1], [1, 1e-9, 1, 1], [1, 1, 0.01, 1]])
    n, token = accept_sampled(rows, drafts, None, None, t([1] * 3, torch.long), u, noise)
    assert n.tolist() == [0, 0, 0]
    assert token.tolist() == [3, 3, 2]  # zero-weight token 1 never wins


def test_greedy_rows_through_the_sampled_rule_match_accept_greedy():
    gen = torch.Generator().manual_seed(3)
    b, k, v = 64, 3, 5
    logits = torch.randn(b, k + 1, v, generator=gen)
    batch = SamplingBatch.from_params([SamplingParams(temperature=0, seed=i) for i in range(b)])
    probs = batch.target_probs(logits)  # one-hot rows
    top = logits.argmax(-1)
    drafts = torch.where(torch.rand(b, k, generator=gen) < 0.7, top[:, :k],
                         torch.randint(0, v, (b, k), generator=gen))
    num = torch.randint(0, k + 1, (b,), generator=gen)
    u, noise = round_noise(batch.seed, torch.full((b,), 10), k, v)
    got = accept_sampled(probs, drafts, None, None, num, u, noise)
    want = accept_greedy(logits, drafts, num)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < int(want[0].sum()) < b * k  # both accepts and rejects happened


def test_round_noise_keys():
    seed, first = t([4, 9], torch.long), t([1, 30], torch.long)
    u, e = round_noise(seed, first, 3, 6)
    assert u.shape == (2, 3) and e.shape == (2, 6)
    for i in range(3):  # draft i sits at first + i
        torch.testing.assert_close(u[:, i], uniform(seed, NoiseStream.ACCEPT, first + i, 1)[:, 0])
    torch.testing.assert_close(e, exponential_noise(seed, NoiseStream.RESIDUAL, first, 6))
    u1, e1 = round_noise(seed[1:], first[1:], 3, 6)  # batch composition does not matter
    assert torch.equal(u1, u[1:]) and torch.equal(e1, e[1:])


# --- the coupled rule (seeded requests) ------------------------------------------------

def test_coupled_rule_by_hand():
    rows = t([[P, ROW2, FLAT]])  # [1, 3, 4]
    noise = t([[[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [9.0, 9.0, 1.0, 9.0]]])
    # the target's own choices: row 0 -> 3 (0.4), row 1 -> 0 (0.7), row 2 -> 2 (noise)
    for drafts, want in (([3, 0], (2, 2)), ([3, 1], (1, 0)), ([1, 0], (0, 3))):
        n, tok = accept_coupled(rows, t([drafts], torch.long), t([2], torch.long), noise)
        assert (int(n), int(tok)) == want
    n, tok = accept_coupled(rows, t([[3, 0]], torch.long), t([1], torch.long), noise)
    assert (int(n), int(tok)) == (1, 0)  # num_drafts = 1: the choice at row 1 follows


def test_coupled_noise_is_keyed_by_absolute_position_only():
    seed, first = t([4, 9], torch.long), t([1, 30], torch.long)
    e = coupled_noise(seed, first, 4, 6)  # [2, 4, 6]
    for i in range(4):  # row i decides position first + i
        assert torch.equal(e[:, i], exponential_noise(seed, NoiseStream.SAMPLE, first + i, 6))
    # a later round starting two positions on reads the same noise at the same positions
    assert torch.equal(coupled_noise(seed[1:], first[1:] + 2, 2, 6)[0], e[1, 2:])


VM = 7  # vocabulary of the Markov toy target below
_E = -torch.rand(VM, VM, generator=torch.Generator().manual_seed(5)).log()
MARKOV = _E / _E.sum(-1, keepdim=True)  # [V, V]: row x is p(. | x), Dirichlet(1) rows


def _plain_keyed(seed: torch.Tensor, first: torch.Tensor, length: int) -> torch.Tensor:
    """Plain decoding of the toy target p(x_P | x_{P-1}) = MARKOV[x_{P-1}]: x_P is the
    race with noise (SAMPLE, P). seed, first [S] (x_0 = first) -> [S, length + 1]."""
    xs = [first]
    for pos in range(1, length + 1):
        noise = exponential_noise(seed, NoiseStream.SAMPLE, torch.tensor(pos), VM)
        xs.append(sample(MARKOV[xs[-1]], noise))
    return torch.stack(xs, 1)


def _speculate(seed, first, length, rng, noise_fn):
    """Rounds of random K, random num_drafts and random drafts (each right with chance
    1/2), the batch shuffled every round, decided by `accept_coupled` -> [S, length + 1]."""
    truth = _plain_keyed(seed, first, 4 * length + 4)  # a round commits at most 4
    seqs = [[int(x)] for x in first]
    while min(len(q) for q in seqs) <= length:
        k = int(rng.integers(0, 4))
        order = rng.permutation(len(seqs))
        drafts = torch.tensor([[int(truth[s, len(seqs[s]) + i]) if rng.random() < 0.5
                                else int(rng.integers(0, VM)) for i in range(k)]
                               for s in order], dtype=torch.long).view(len(order), k)
        nd = torch.tensor([int(rng.integers(0, k + 1)) for _ in order])
        last = torch.tensor([seqs[s][-1] for s in order])
        rows = torch.cat([last[:, None], drafts], 1)  # [S, K+1]: x[N], d1..dK
        n_pos = torch.tensor([len(seqs[s]) for s in order])  # N+1 for each sequence
        noise = noise_fn(seed[order], n_pos, k + 1, VM)
        n, nxt = accept_coupled(MARKOV[rows], drafts, nd, noise)
        for row, s in enumerate(order):
            seqs[s] += drafts[row, :int(n[row])].tolist() + [int(nxt[row])]
    return torch.tensor([q[:length + 1] for q in seqs])


def test_coupled_rule_commits_the_plain_keyed_samples_whatever_the_drafts():
    seed, first = torch.arange(24) * 1_000_003 - 7, torch.arange(24) % VM
    plain = _plain_keyed(seed, first, 30)
    got = _speculate(seed, first, 30, np.random.default_rng(0), coupled_noise)
    assert torch.equal(got, plain)
    assert len(set(plain[:, 1:].flatten().tolist())) == VM  # really sampled

    def by_round_start(seed, first_pos, rows, v):  # the bug the rule fixes
        return coupled_noise(seed, first_pos, 1, v).expand(-1, rows, -1)
    broken = _speculate(seed, first, 30, np.random.default_rng(0), by_round_start)
    assert not torch.equal(broken, plain)  # the check has power

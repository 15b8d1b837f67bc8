"""Chi-square helpers for distribution tests (rule level here, end to end elsewhere).

Both return a p-value. Cells whose expected count is below `min_expected` are pooled (the
usual validity condition of the chi-square approximation), smallest first.
"""

from __future__ import annotations

import numpy as np
from scipy import stats


def chi_square_vs_expected(counts, probs, min_expected: float = 5.0) -> float:
    """Goodness of fit of observed `counts` to exact `probs` (same shape, any dims).
    An outcome with probability 0 that was observed gives p-value 0."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts.shape != probs.shape:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} differ")
    if np.any(probs < 0) or abs(probs.sum() - 1.0) > 1e-6:
        raise ValueError("probs must be a distribution")
    if np.any(counts[probs == 0] > 0):
        return 0.0
    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    obs, exp = _pool(counts[keep][None, :], expected, min_expected)
    if obs.shape[1] < 2:
        return 1.0
    return float(stats.chisquare(obs[0], exp).pvalue)


def chi_square_two_sample(counts_a, counts_b, min_expected: float = 5.0) -> float:
    """Homogeneity of two samples over the same outcomes (2 x C contingency table), for
    when the exact distribution is unknown: e.g. speculative vs plain decoding."""
    a = np.asarray(counts_a, dtype=np.float64).ravel()
    b = np.asarray(counts_b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"counts {a.shape} and {b.shape} differ")
    table = np.stack([a, b])
    totals = table.sum(axis=0)
    # Expected count of the smaller sample decides validity: pool on that.
    share = table.sum(axis=1).min() / table.sum()
    obs, _ = _pool(table[:, totals > 0], totals[totals > 0] * share, min_expected)
    if obs.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(obs, correction=False).pvalue)


def _pool(obs: np.ndarray, expected: np.ndarray, min_expected: float
          ) -> tuple[np.ndarray, np.ndarray]:
    """Merge the columns with the smallest `expected` into one until it reaches
    min_expected. obs [rows, C], expected [C] -> pooled versions."""
    order = np.argsort(expected, kind="stable")
    small = np.cumsum(expected[order]) < min_expected
    if not small.any():
        return obs, expected
    n_pool = min(int(small.sum()) + 1, len(order))  # the cell that crosses the threshold
    pooled, rest = order[:n_pool], order[n_pool:]
    obs = np.concatenate([obs[:, rest], obs[:, pooled].sum(axis=1, keepdims=True)], axis=1)
    return obs, np.append(expected[rest], expected[pooled].sum())

"""The pure decision of adaptive draft depth (DESIGN 4.11): given per-position acceptance
estimates and a step's cost, the depth per sequence that maximises the step's expected
committed tokens per second, and (drafter-side depth) the draft round's depth with it.
`adaptive_depth.AdaptiveDepth` holds the estimates it is fed with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StepCost:
    """Seconds: the forward is `fixed_s + per_row_s * rows`; a draft round of D steps
    `draft_s + draft_step_s * D`, once if any sequence drafts (drafter-side depth: the
    round runs as many steps as the deepest sequence verifies)."""

    fixed_s: float
    per_row_s: float
    draft_s: float = 0.0
    draft_step_s: float = 0.0

    def round_s(self, depth: int) -> float:
        return self.draft_s + self.draft_step_s * depth


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Expected committed tokens of a verify window with k drafts: the bonus token plus
    the chance each prefix of drafts is accepted."""
    total, reach = 1.0, 1.0
    for a in rates[:k]:
        reach *= a
        total += reach
    return total


def choose_depths(rates: Sequence[Sequence[float]], caps: Sequence[int], cost: StepCost,
                  other_rows: int = 0, margin: float = 0.0) -> list[int]:
    """Depth per sequence maximising (expected tokens) / (step seconds).

    `rates[s][i]`: sequence s's conditional acceptance of draft i+1; `caps[s]`: most drafts
    it may verify; `other_rows`: rows of the step that are not verify windows (prefill).
    Each extra draft of s adds `prod(rates[s][:k+1])` tokens (falling in k) for
    `per_row_s` seconds, so the best set is a prefix of the gains in falling order: take
    a gain while it beats the current tokens per second. Drafting at all also costs
    `draft_s`; the result is all zeros unless that beats plain by the factor
    `1 + margin`."""
    n = len(rates)
    base_tokens = float(n)
    base_s = cost.fixed_s + cost.per_row_s * (n + other_rows)
    gains: list[tuple[float, int]] = []
    for s, (r, cap) in enumerate(zip(rates, caps, strict=True)):
        reach = 1.0
        for a in r[:cap]:
            reach *= a
            gains.append((reach, s))
    gains.sort(key=lambda g: -g[0])
    depths = [0] * n
    tokens, seconds = base_tokens, base_s + cost.draft_s
    taken = 0
    for gain, _ in gains:
        if gain * seconds <= cost.per_row_s * tokens:  # gain/per_row <= tokens/seconds
            break
        tokens += gain
        seconds += cost.per_row_s
        taken += 1
    if not n or not taken or tokens * base_s <= (1 + margin) * base_tokens * seconds:
        return depths  # plain decoding is at least as fast
    for _, s in gains[:taken]:
        depths[s] += 1
    return depths


def choose_round(rates: Sequence[Sequence[float]], caps: Sequence[int], cost: StepCost,
                 other_rows: int = 0, margin: float = 0.0) -> list[int]:
    """`choose_depths` with the draft round priced by its depth D (`StepCost.round_s`):
    each D in 1..max(caps) caps every sequence at D and pays a D-step round; the best
    tokens per second wins (all zeros: plain). With no per-step cost, D = max(caps)."""
    best, best_rate = [0] * len(caps), 0.0
    for depth in range(max(caps, default=0), 0, -1):
        out = choose_depths(rates, [min(c, depth) for c in caps],
                            replace(cost, draft_s=cost.round_s(depth)), other_rows, margin)
        if not any(out):
            continue
        rows = sum(1 + k for k in out) + other_rows
        tokens = sum(expected_tokens(r, k) for r, k in zip(rates, out, strict=True))
        rate = tokens / (cost.fixed_s + cost.per_row_s * rows + cost.round_s(max(out)))
        if rate > best_rate:
            best, best_rate = out, rate
    return best

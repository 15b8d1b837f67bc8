"""Draft-ahead (DESIGN 4.8): proposals for the likely verdicts of a round still being
verified, so that a verifier with a hit starts its next round without waiting.

After a round drafted for bonus index N', the verifier verifies m drafts v_1..v_m (the
drafter's own, or look-ahead drafts it already holds). Its verdict is an accept length
a (0..m) and a bonus b; it commits x[N'+1..N'+a+1] = v_1..v_a, b. A *hypothesis* is one
such outcome (a, b):
- a < m: b is a correction, b != v_{a+1}: one of the drafter's best alternatives at
  step a+1 of row N'-1 (its distribution for x[N'+a+1]);
- a = m: b is a bonus guess, from a first look-ahead pass (the *bonus pass*): the old
  single window, history rows then rows N'..N'+m-1, whose step 1 at its last row is the
  drafter's distribution for x[N'+m+1].
Its estimated probability is P(a) * P(b | a): P(a) from per-position acceptance rates
the drafter measures from the verdicts its updates report (`AcceptRates`; its own q of
v_i is not calibrated: a small drafter's distribution is flat where the target agrees),
P(b | a) from the drafter's distribution for that token (renormalized without v_{a+1}
for a correction). Hypotheses are ranked by it; `select` spends the round's row budget
(it bounds the look-ahead's time beside the verify step) where it raises most the
chance that every sequence of the step hits.

A hypothesis drafts exactly as the update with its outcome would: its window is the
sequence's history rows (exact), then rows N'..N'+a with tokens v_1..v_a, b and, in place
of the target hidden states h[N'+i] the drafter does not have yet, its own chain states
g[i+1] at row N'-1 (g[k] at row p is trained to predict x[p+k+1], as h[p+k] does), and
for row N'+m (a = m) the bonus pass's g[1] at row N'+m-1. One ordinary draft round over
that window gives the full K drafts after b. The entry is keyed by (N', v_1..v_a, b).

Exactness: each look-ahead window runs on copy-on-write scratch blocks: the sequence's
blocks below the window's first row, then a copy of the block that row falls in and fresh
blocks after it, all freed after the round. A window reads positions < its first row
(history start N'-(K-1), all final, DESIGN 3.2) from the shared blocks and writes only
scratch ones, so the sequence's real MTP cache, history rows and expected start are
exactly as without look-ahead, and hypotheses of one sequence never see each other.
"""

from __future__ import annotations

import collections
import heapq
import math
import statistics
from dataclasses import dataclass

import torch

from chainspec.engine.draft_batch import Window
from chainspec.engine.draft_step import DraftOutput
from chainspec.engine.draft_types import DraftAhead, DraftResult


@dataclass(frozen=True)
class AheadSource:
    """What a look-ahead for one sequence starts from (taken when its round drafted)."""

    seq_id: int
    base: int  # N': the bonus index of the round being verified
    verify: torch.Tensor  # [m] int64: the drafts that round verifies
    chain: torch.Tensor  # [>= m, H]: g[1..] at row N'-1 (stand-ins for h[N'..])
    temperature: float
    seed: int
    # chain[k] is the output of draft step k + 1 + step0: 0, or 1 for a bonus pass's
    # entry, whose states are those of the row before N'-1, one step further
    step0: int = 0


class AcceptRates:
    """P(draft i accepted | drafts before it accepted), per position, from verdicts: an
    exponentially decayed count, starting from `prior`."""

    def __init__(self, num_steps: int, prior: float = 0.7, weight: float = 8.0,
                 decay: float = 0.995) -> None:
        self.accepted = [prior * weight] * num_steps
        self.tried = [weight] * num_steps
        self.decay = decay

    def record(self, verified: int, accepted: int) -> None:
        """A verdict: `accepted` of `verified` drafts."""
        for i in range(min(accepted + 1, verified)):
            self.tried[i] = self.tried[i] * self.decay + 1
            self.accepted[i] = self.accepted[i] * self.decay + (i < accepted)

    def lengths(self, m: int) -> list[float]:
        """P(accept length = a) for a = 0..m."""
        out, prefix = [], 1.0
        for i in range(m):
            rate = self.accepted[i] / self.tried[i]
            out.append(prefix * (1 - rate))
            prefix *= rate
        return [*out, prefix]


@dataclass(frozen=True)
class Hypothesis:
    """One verdict (a, b) of the round at `src.base` and the rows its update would bring."""

    src: AheadSource
    outcome: tuple[int, ...]  # [a + 1]: v_1..v_a, b
    hidden: torch.Tensor  # [a + 1, H]: stand-ins for h[N'..N'+a]
    prob: float  # estimated probability of this verdict
    rank: int = 0  # its place among the sequence's hypotheses, best first

    @property
    def accepted(self) -> int:
        return len(self.outcome) - 1


def history_window(blocks: tuple[int, ...], first: int, hidden: torch.Tensor,
                   tokens: torch.Tensor, hist_hidden: torch.Tensor | None,
                   hist_tokens: torch.Tensor | None, src: AheadSource) -> Window:
    """The sequence's history rows, then rows from `first` (= N') on."""
    if hist_hidden is not None:
        hidden = torch.cat([hist_hidden, hidden.to(hist_hidden.dtype)])
        tokens = torch.cat([hist_tokens, tokens])
        first -= hist_hidden.shape[0]
    return Window(blocks, first, hidden, tokens, src.temperature, src.seed)


def bonus_rows(src: AheadSource) -> tuple[torch.Tensor, torch.Tensor]:
    """The bonus pass's rows N'..N'+m-1: hidden [m, H] and tokens [m]."""
    m = src.verify.shape[0]
    return src.chain[:m], src.verify


def corrections(src: AheadSource, step_logits: torch.Tensor, fanout: int,
                lengths: list[float]) -> list[Hypothesis]:
    """(a, b) for a < m, b among the top `fanout` alternatives to v_{a+1}, unranked.
    step_logits [K, V]: the drafter's steps at row N'-1; lengths [m + 1]: P(a)."""
    m = src.verify.shape[0]
    q = step_logits[:m].float().softmax(-1)  # [m, V]
    verify = src.verify.tolist()
    out = []
    for a in range(m):
        alt = q[a].clone()
        alt[verify[a]] = 0.0  # a correction differs from the rejected draft
        alt /= alt.sum().clamp_min(1e-12)
        top = alt.topk(fanout)
        for p, b in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            out.append(Hypothesis(src, (*verify[:a], b), src.chain[:a + 1], lengths[a] * p))
    return out


def full_accepts(src: AheadSource, bonus_logits: torch.Tensor, bonus_state: torch.Tensor,
                 fanout: int, p_all: float) -> list[Hypothesis]:
    """(m, b) for b among the top `fanout` bonus guesses, unranked. bonus_logits [V] and
    bonus_state [H]: step 1 at the bonus pass's last row (x[N'+m+1]) and its g[1];
    p_all: P(a = m)."""
    m = src.verify.shape[0]
    top = bonus_logits.float().softmax(-1).topk(fanout)
    hidden = torch.cat([src.chain[:m], bonus_state.view(1, -1).to(src.chain)])
    verify = src.verify.tolist()
    return [Hypothesis(src, (*verify, b), hidden, p_all * p)
            for p, b in zip(top.values.tolist(), top.indices.tolist(), strict=True)]


def select(candidates: list[Hypothesis], budget: int, hist_rows: dict[int, int],
           covered: dict[int, float] | None = None, spent: int = 0) -> list[Hypothesis]:
    """The hypotheses to draft, each ranked within its sequence (likeliest first).

    A step waits for no drafts only if every sequence in it hits, so the aim is the
    probability that all hit, prod_s C_s (C_s: the covered probability of sequence s).
    Without `covered`, every sequence gets its likeliest hypothesis (the cost of a
    one-hypothesis look-ahead); more follow by the gain in log C_s per row while
    `budget` rows (all windows, history rows included; `spent` of them already) last.
    `hist_rows`: history rows per sequence."""
    per_seq: dict[int, list[Hypothesis]] = {}
    for h in sorted(candidates, key=lambda h: -h.prob):
        per_seq.setdefault(h.src.seq_id, []).append(h)

    def rows(h: Hypothesis) -> int:
        return hist_rows[h.src.seq_id] + len(h.outcome)
    if covered is None:
        chosen = {s: [hs[0]] for s, hs in per_seq.items()}
        covered = {s: hs[0].prob for s, hs in per_seq.items()}
        spent += sum(rows(hs[0]) for hs in chosen.values())
        first = 1
    else:
        chosen, covered, first = {s: [] for s in per_seq}, dict(covered), 0
    heap = [(-_gain(covered.get(s, 0.0), hs[first], rows(hs[first])), s, first)
            for s, hs in per_seq.items() if len(hs) > first]
    heapq.heapify(heap)
    while heap:
        _, s, i = heapq.heappop(heap)
        h = per_seq[s][i]
        if spent + rows(h) <= budget:
            spent += rows(h)
            chosen[s].append(h)
            covered[s] = covered.get(s, 0.0) + h.prob
        if i + 1 < len(per_seq[s]):
            nxt = per_seq[s][i + 1]
            heapq.heappush(heap, (-_gain(covered.get(s, 0.0), nxt, rows(nxt)), s, i + 1))
    return [Hypothesis(h.src, h.outcome, h.hidden, h.prob, rank)
            for hs in chosen.values() for rank, h in enumerate(hs)]


def ranked(hyps: list[Hypothesis]) -> list[Hypothesis]:
    """`hyps` (grouped by sequence, best first) with their ranks within the sequence."""
    out, seen = [], {}
    for h in hyps:
        rank = seen[h.src.seq_id] = seen.get(h.src.seq_id, -1) + 1
        out.append(Hypothesis(h.src, h.outcome, h.hidden, h.prob, rank))
    return out


def _gain(covered: float, h: Hypothesis, rows: int) -> float:
    if covered <= 0.0:
        return math.inf if h.prob > 0 else 0.0
    return math.log1p(h.prob / covered) / rows


class AheadClock:
    """How many look-ahead rows fit before the verifier's next update arrives: past that,
    the next exact update would wait behind the look-ahead, and its entries arrive after
    the verdict they guess. The next update comes one verify step after the verifier had
    what it waited for: our answer on a miss, its own update when every sequence held a
    hit's drafts (then it waited for nothing). So the clock keeps the recent intervals
    from an answer to the next update per kind of step (hit or miss), and a look-ahead
    after an answer may end by `share` of the shortest of that kind. A round costs a
    fixed part, taken as the exact round's time (an exponential average; on a CPU most
    of a small round is per-layer overhead), plus a part per row: the median over
    recent look-ahead rounds (NOTE: one round descheduled by another process must not
    make every look-ahead look too long for a while)."""

    def __init__(self, share: float = 0.8, recent: int = 8, smoothing: float = 0.3) -> None:
        self.share = share  # of the interval the look-ahead may end by
        self.smoothing = smoothing
        self.gaps: dict[bool, collections.deque[float]] = {
            hit: collections.deque(maxlen=recent) for hit in (False, True)}
        self.round_s: float | None = None  # a round's fixed cost
        self._row_costs: collections.deque[float] = collections.deque(maxlen=4 * recent)
        self._answered: float | None = None
        self._hit = False  # the kind of the step answered last

    def update_started(self, now: float) -> None:
        if self._answered is not None:
            self.gaps[self._hit].append(now - self._answered)
        self._answered = None

    def answered(self, now: float, hit: bool) -> None:
        """The exact answer is out; `hit`: the verifier holds drafts for every sequence
        of the step (it waits for no answer)."""
        self._answered, self._hit = now, hit

    def exact_done(self, seconds: float) -> None:
        self.round_s = self._average(self.round_s, seconds)

    def round_done(self, rows: int, seconds: float) -> None:
        if self.round_s is not None:
            self._row_costs.append(max(0.0, seconds - self.round_s) / max(rows, 1))

    @property
    def row_s(self) -> float | None:
        """Seconds per look-ahead row beyond a round's fixed cost."""
        return statistics.median(self._row_costs) if self._row_costs else None

    def rows_left(self, now: float) -> int | None:
        """Rows a look-ahead round may still have before the next update (0: no round
        fits); None while nothing is measured yet."""
        gaps = self.gaps[self._hit]
        if not gaps or self.round_s is None or self._answered is None:
            return None
        left = self.share * min(gaps) - (now - self._answered) - self.round_s
        if left < 0:
            return 0
        row_s = self.row_s
        return 10 ** 9 if not row_s else int(left / row_s)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)


def hypothesis_window(h: Hypothesis, blocks: tuple[int, ...],
                      hist_hidden: torch.Tensor | None,
                      hist_tokens: torch.Tensor | None) -> Window:
    tokens = torch.tensor(h.outcome, dtype=torch.int64)
    return history_window(blocks, h.src.base, h.hidden, tokens, hist_hidden, hist_tokens,
                          h.src)


def ahead_entry(h: Hypothesis, out: DraftOutput, row: int, sampled: bool) -> DraftAhead:
    """Row `row` of the hypotheses' round as an entry: the K drafts after its outcome.
    NOTE: entries travel in rank order per sequence; a receiver's index is the rank."""
    src = h.src
    position = src.base + len(h.outcome)
    tokens = out.tokens[row].cpu().clone()  # [K]
    if sampled:
        drafts = DraftResult(src.seq_id, position, tokens, out.support[row].cpu(),
                             out.probs[row].float().cpu())
    else:
        drafts = DraftResult(src.seq_id, position, tokens)
    return DraftAhead(src.seq_id, src.base, h.outcome, drafts)


def bonus_entry(src: AheadSource, out: DraftOutput, row: int, sampled: bool) -> DraftAhead:
    """The bonus pass's row as an entry for (m, its own bonus guess): step 1 is the
    guess, steps 2..K the K-1 drafts after it (a = m without a second round)."""
    tokens = out.tokens[row].cpu()  # [K]
    outcome = (*src.verify.tolist(), int(tokens[0]))
    position = src.base + len(outcome)
    if sampled:
        drafts = DraftResult(src.seq_id, position, tokens[1:].clone(),
                             out.support[row, 1:].cpu(), out.probs[row, 1:].float().cpu())
    else:
        drafts = DraftResult(src.seq_id, position, tokens[1:].clone())
    return DraftAhead(src.seq_id, src.base, outcome, drafts)

"""Adaptive draft depth (DESIGN 4.11): each step, k in 0..K drafts per sequence, chosen
to maximise expected committed tokens per second of the step.

Two estimates feed the choice, both measured online, neither tuned by the user:
- acceptance per draft position: `a[i]` = P(draft i+1 accepted | drafts 1..i accepted),
  per sequence, with the global per-position rates as its prior;
- the step's cost: `fixed_s + per_row_s * rows` for the forward (a verify window is k + 1
  rows, a plain decode row 1) plus the step's other work, and `draft_s`, the draft round
  as the verifier sees it (its wait for drafts and the drafter work it does itself,
  timed directly), paid when any sequence drafts, priced per draft step it runs (the
  drafter runs only the steps the deepest sequence needs: `choose_round`). A step where
  none drafts runs no draft round (verifier_drafts.py holds the rows back).

Three guards keep the estimates honest under load: the draft round's cost is a rolling
median of rounds with no prompt rows in them (a prompt's rows are the drafter's to take
whatever the depth, and would price drafting out); switching drafting back on must beat
plain by `SWITCH_MARGIN` (no flapping on noise); and after `EXPLORE_AFTER` plain steps
one step asks for drafts again, so a load that fell is noticed. The step's other work is
measured apart for steps that asked for drafts and steps that did not: the drafter
client's threads (decoding drafts, encoding rows) take the GIL from the step, a cost of
drafting. Last, the gate (`ModeGate`): the seconds steps actually took, from one step's
start to the next, with drafts verified and with no drafter traffic at all, per batch-size
bucket. It sees what the cost model cannot (the drafter's process taking the host's
cores, the wire): once both are measured at the batch's size, its medians replace the
model's step cost and draft round, and `choose_depths` decides on them with the
sequences' own rates (a hard prompt goes plain alone; the next one drafts again), every
sequence of a drafting step verifying the round's depth (to its cap). Probe
spells keep both sides measured: after `PROBE_SOON` drafting steps (`PROBE_PLAIN_AFTER`
once drafting measured a clear lead) `SPELL` steps draft nothing, after `EXPLORE_AFTER`
plain steps `SPELL` + 1 steps draft at the caps; each probe that leaves the choice as it
was doubles its period (to `MAX_BACKOFF` times), so a settled choice is rarely disturbed.
A return to drafting sends the drafter every row held meanwhile (at 64 sequences, a
second of drafter work on a small host): its measured cost (`flush_s`) holds the next
probe from plain back until plain ran 1 / `FLUSH_SHARE` times as long (running: idle waits
between requests repay nothing), and a load heavier than one where drafting measured
behind plain is not probed at once on entering it (the lead falls with load). A plain
probe spell runs on (to `LONGEST_SPELL`) until plain is measured at the load (the
drafter's backlog keeps its steps from being samples), but not once the load left the
bucket it measures, and starts at once where only drafting is measured, so the gate, not
the model, decides. The same rule (the lead falls as the batch grows) reads the gate for
steps whose size is not the load's: a drafting step smaller than the load (a wave's
tail) is judged by the figures measured nearest its own size, and starts no plain probe;
a load never measured takes the figures of the nearest heavier one where drafting led,
and is not probed (`_own_size`, `_inferred`).

`choose_depths` and `choose_round` (`depth_choice.py`) are the pure decision;
`AdaptiveDepth` holds the estimates. Depth changes
which drafts are verified, never how: the acceptance rule decides every token (3.3).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

from chainspec.engine.depth_choice import (
    StepCost,
    choose_depths,
    choose_round,
    expected_tokens,
)

PRIOR_RATE = 0.7  # global rate before any round is seen: optimistic, so drafting starts
PRIOR_WEIGHT = 4.0  # rounds' worth of weight the global rate has in a sequence's estimate
SEQ_DECAY = 0.9  # a sequence's running estimate: weight of the past per new round
GLOBAL_DECAY = 0.995  # global rates: slow forgetting
COST_DECAY = 0.98  # step cost fit: weight of the past per step
COST_WINDOW = 32  # steps in the rolling medians of the draft round and the overhead
MIN_CLEAN = 4  # rounds without prompt rows before their median is trusted
SWITCH_MARGIN = 0.05  # from plain, drafting must promise this much more tokens/s (the
# switch sends the drafter every row held meanwhile: at 64 sequences, a second's round)
HOLD_MARGIN = 0.1  # once measured, drafting stops only this much behind plain (a switch
# back costs a flush, and a sequence's estimate dips on a few rejected rounds)
EXPLORE_AFTER = 64  # plain steps in a row before one asks for drafts again
FLUSH_SHARE = 0.05  # and not before the last switch's flush is this share of plain's time
PROBE_PLAIN_AFTER = 256  # drafting steps in a row before a plain spell, once drafting
CLEAR_LEAD = 1.25  # measured this lead at the batch's size;
PROBE_SOON = 32  # until then
SPELL = 6  # steps of a plain probe spell (its first one only stops the drafter traffic;
# a drafting spell has one more: its first two flush the held rows and wait for drafts)
LONGEST_SPELL = 256  # steps a plain probe spell may run on until plain is measured
SETTLE = 8  # steps after the last that asked for drafts before a plain step is a sample
GATE_MIN = 5  # measured steps of each kind, at the batch's size, before the gate decides
MAX_BACKOFF = 16  # probes at most 16x rarer once they keep confirming the choice
LOAD_DECAY = 0.95  # the load's running mean (the gate's batch size): weight of the past


@dataclass
class PositionCounts:
    """Decayed rounds that reached draft position i (`trials`) and accepted it (`hits`)."""

    trials: list[float]
    hits: list[float]

    @classmethod
    def empty(cls, num_steps: int) -> PositionCounts:
        return cls([0.0] * num_steps, [0.0] * num_steps)

    def record(self, num_drafts: int, accepted: int, decay: float) -> None:
        """A round verified `num_drafts` drafts and accepted the first `accepted`; the
        positions past the first rejection were not tried."""
        for i in range(len(self.trials)):
            self.trials[i] *= decay
            self.hits[i] *= decay
        for i in range(min(num_drafts, accepted + 1)):
            self.trials[i] += 1.0
            self.hits[i] += i < accepted

    def rates(self, prior: Sequence[float], weight: float) -> list[float]:
        return [(h + weight * p) / (t + weight)
                for h, t, p in zip(self.hits, self.trials, prior, strict=True)]


@dataclass
class _LinearFit:
    """Exponentially weighted least squares of y = a + b * x (seconds against rows)."""

    decay: float
    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.sw, self.sx, self.sy = d * self.sw + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def coefficients(self) -> tuple[float, float] | None:
        if self.sw == 0:
            return None
        mx, my = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mx * mx
        if var < 0.25 or mx <= 0:  # NOTE: rows barely varied: split the mean cost evenly
            b = 0.5 * my / max(mx, 1.0)
        else:
            b = max(0.0, (self.sxy / self.sw - mx * my) / var)
        return max(0.0, my - b * mx), b


def bucket(batch: int) -> int:
    """The gate's batch-size bucket: an octave around a power of two (46..90 is 64's).
    NOTE: not bit_length: a batch that hovers at 64 would split between 32..63 and 64..127."""
    return round(math.log2(batch))


@dataclass(frozen=True)
class Measured:
    """The gate's figures at one load, each the median seconds of a step: `plain_s` of
    plain steps; `hit_s` of drafting steps with drafts in hand, `miss_s` of those
    without (they waited out the round's deadline, then decoded plain); `hit`, the share
    of drafting steps that had them. Raw step times, not extrapolated by rows: at 64
    sequences a row-cost fit turned a lead of 0.73 at 59 sequences into 1.46 at 37."""

    plain_s: float
    hit_s: float
    miss_s: float
    hit: float

    def lead(self, tokens_per_seq: float) -> float:
        """Drafting's tokens per second over plain's, when a round with drafts in hand
        commits `tokens_per_seq` a sequence (a miss, or a plain step, commits 1)."""
        drafting_s = self.hit * self.hit_s + (1 - self.hit) * self.miss_s
        tokens = self.hit * tokens_per_seq + (1 - self.hit)
        return tokens * self.plain_s / drafting_s if drafting_s > 0 else 1.0


@dataclass
class ModeGate:
    """Measured seconds of steps (one step's start to the next one's; rows kept beside),
    per batch-size bucket: steps of a drafting spell, and steps with no drafter traffic.
    Times, not tokens per second: what a step yields is its sequences' own acceptance
    (the rates); what it costs is the batch size's. NOTE: a gate on tokens per second let
    one hard prompt's rounds (a token a round) price drafting out for the prompts after
    it, while they stayed in the window: at c=1, plain in 492 of 804 rounds."""

    samples: dict[tuple[int, bool], deque] = field(default_factory=dict)

    def add(self, batch: int, drafted: bool, rows: int, seconds: float,
            verified: bool = False) -> None:
        if batch > 0 and seconds > 0:
            key = (bucket(batch), drafted)
            self.samples.setdefault(key, deque(maxlen=COST_WINDOW)).append(
                (rows, seconds, verified))

    def count(self, batch: int, drafted: bool) -> int:
        return len(self.samples.get((bucket(batch), drafted), ()))

    def measured(self, batch: int) -> Measured | None:
        """None until both kinds have GATE_MIN steps at this batch size."""
        return self.measured_at(bucket(batch))

    def measured_at(self, level: int) -> Measured | None:
        """`measured` by bucket."""
        plain = self.samples.get((level, False), ())
        drafting = self.samples.get((level, True), ())
        if len(plain) < GATE_MIN or len(drafting) < GATE_MIN:
            return None
        hits = [s for _, s, v in drafting if v]
        misses = [s for _, s, v in drafting if not v] or hits
        plain_s = statistics.median(s for _, s, _ in plain)
        hit_s = statistics.median(hits or misses)
        return Measured(plain_s, hit_s, statistics.median(misses), len(hits) / len(drafting))


@dataclass
class AdaptiveDepth:
    """The estimates behind `choose_depths`, fed by the verifier after each step."""

    num_steps: int  # K
    seqs: dict[Hashable, PositionCounts] = field(default_factory=dict)
    global_counts: PositionCounts | None = None
    forward: _LinearFit = field(default_factory=lambda: _LinearFit(COST_DECAY))
    # draft rounds: (seconds, the draft steps asked for)
    rounds: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    clean_rounds: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    overheads: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW))  # s
    plain_overheads: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW))
    plain_steps: int = 0  # steps in a row that chose no drafts
    drafting_steps: int = 0  # steps in a row that chose some
    gate: ModeGate = field(default_factory=lambda: ModeGate())
    spell: tuple[int, bool] = (0, False)  # probe steps left, and whether they draft
    backoff: int = 1  # probe periods' factor: doubles while probes confirm the choice
    lead: float = 0.0  # the last choice's measured tokens/s over plain's (0: unmeasured)
    _probing: bool | None = None  # whether the steps before the running spell drafted
    _spell_steps: int = 0  # steps of the running spell
    _spell_level: int = 0  # the gate bucket it measures
    _backlog: bool = False  # the last plain step was no sample: the drafter's backlog
    flush_s: float = 0.0  # the last switch to drafting: its steps until drafts flowed
    load: float | None = None  # running mean of the sequences a step verifies
    ask: int = 0  # draft steps the next round should run (drafter-side depth); 0: K
    plain_s: float = 0.0  # seconds of plain steps since drafting last ran (busy, not idle)
    behind: dict[int, bool] = field(default_factory=dict)  # per gate bucket: drafting, at
    # the global acceptance (a cost, not one prompt's), last measured behind plain there
    _flush_started: float | None = None
    _asked_s: float = float("-inf")  # when a step last asked for drafts
    _since_asked: int = SETTLE  # steps since then
    _last: tuple[bool, bool] = (False, False)  # the previous step asked, had prompt rows
    _asked_earlier: bool = False  # the step before the previous one asked for drafts
    _open: tuple | None = None  # the last step: start, busy s, overhead, asked, gate sample

    def __post_init__(self) -> None:
        if self.global_counts is None:
            self.global_counts = PositionCounts.empty(self.num_steps)

    def prior(self) -> list[float]:
        return self.global_counts.rates([PRIOR_RATE] * self.num_steps, 1.0)

    def rates(self, key: Hashable) -> list[float]:
        prior = self.prior()
        counts = self.seqs.get(key)
        return prior if counts is None else counts.rates(prior, PRIOR_WEIGHT)

    def cost(self) -> StepCost | None:
        """None until a step was measured: verify at full depth meanwhile."""
        fit = self.forward.coefficients()
        if fit is None:
            return None
        rounds = self.clean_rounds if len(self.clean_rounds) >= MIN_CLEAN else self.rounds
        # NOTE: a round's time per draft step it ran: rounds of several depths in one
        # median (drafter-side depth), a K-step round costing K of them
        per_step = statistics.median(s / d for s, d in rounds) if rounds else 0.0
        draft = 0.0
        drafting = statistics.median(self.overheads) if self.overheads else None
        plain = statistics.median(self.plain_overheads) if self.plain_overheads else None
        if drafting is not None and plain is not None:
            draft += max(0.0, drafting - plain)  # the drafter client's threads' share
        overhead = plain if plain is not None else drafting or 0.0
        return StepCost(fit[0] + overhead, fit[1], draft, per_step)

    def depths(self, keys: Sequence[Hashable], caps: Sequence[int],
               other_rows: int = 0, demand: int = 0) -> list[int]:
        cost = self.cost()
        if cost is None or not any(caps):  # NOTE: nothing to draft is no plain decision
            return list(caps)  # (a request's last token; requests capped at 0)
        n = len(caps)
        rates = [self.rates(k) for k in keys]
        # NOTE: the gate's batch size is the load's running mean: in a closed loop the
        # batch swings (64 -> 21 as a wave of requests ends), and a choice per bucket
        # flipped with it, each flip paying a flush. NOTE: following a rise at once (and
        # a fall slowly) measured worse: 0.73 and 0.74 at c=16 and 32, against 0.87, 0.92
        # NOTE: `demand` (the sequences running and waiting, to the most that run) leads
        # it: a closed loop's 64 requests arrive in one step, and the mean, still at the
        # last point's tail, drafted its first 5-25 steps at the lighter load's verdict
        self.load = n if self.load is None else LOAD_DECAY * self.load + (1 - LOAD_DECAY) * n
        self.load = max(self.load, float(demand))
        load = max(1, round(self.load))
        measured = at_load = self.gate.measured(load)  # NOTE: the model's until then
        plain = self.plain_steps or self._probing is False
        inferred = False
        if not self.spell[0]:
            if not plain:  # NOTE: a switch to drafting flushes every held row: the load's
                measured = self._own_size(max(n, demand), load, at_load)  # call, not a tail's
            if measured is None:
                measured = self._inferred(load)
                inferred = measured is not None
        self._probe(load, measured is not None, inferred, max(n, demand))
        left, draft = self.spell
        if left:
            self._spell_steps += 1
            # NOTE: a plain spell runs on while its steps are no samples (the drafter works
            # off the last flush, 2 x flush_s) until plain is measured at this load: at
            # c=64 on a loaded host the backlog outlasted SPELL steps, plain stayed
            # unmeasured, and the model decided: drafting in ~half the rounds
            # NOTE: and on while plain is unmeasured here at all, backlog or not: the
            # spell's first step and prompt steps' lag gave 6-step spells at c=64 fewer
            # than GATE_MIN samples, and the model drafted 11 steps before the next one
            # NOTE: but not past the load it measures: at c=16 a probe spell in the tail
            # ran on as the load's mean fell a bucket, 20 steps of 2 sequences plain
            if draft or left > 1 or self.gate.count(load, False) >= GATE_MIN or \
                    self._spell_steps >= LONGEST_SPELL or bucket(load) != self._spell_level:
                self.spell = (left - 1, draft)
            if draft:
                self.ask = max(caps, default=0)
            return list(caps) if draft else [0] * n
        if measured is None:  # NOTE: plain stays plain: a switch flushes every held row
            out = [0] * n if self.plain_steps else choose_round(rates, caps, cost, other_rows)
            self.lead = 0.0
        else:  # the model picks the round's depth (a round that runs costs the rows
            # only); drafting at all is the measurement's call, with hysteresis both ways
            # NOTE: not priced per draft step here: the gate's drafting figure is of the
            # depths that ran, so a shallower choice lowered its tokens, not its time, and
            # (a step's time over steps run counting the wire in) c=1 chose 2-3 where K=4
            # led: 0.957 of it, and c=16 decoded plain in 77 % of rounds (0.846)
            out = choose_depths(rates, caps, replace(cost, draft_s=0.0, draft_step_s=0.0),
                                other_rows)
            # NOTE: every sequence verifies the round's depth (to its cap): the round runs
            # that many steps for all of them, and verify rows are what a shallower
            # sequence saves. At c=32 a spread that cut 11 % of the drafts (3.29 -> 2.93
            # tokens a sequence-step) saved 3 % of a step (41.4 against 42.8 ms)
            out = [min(max(out), c) for c in caps]
            tokens = sum(expected_tokens(r, k) for r, k in zip(rates, out, strict=True))
            self.lead = measured.lead(tokens / n) if any(out) else 1.0
            bar = 1 + SWITCH_MARGIN if plain else 1 - HOLD_MARGIN
            out = out if self.lead > bar else [0] * n
            if measured is at_load:  # the load's own figures
                typical = expected_tokens(self.prior(), max(caps, default=0))
                self.behind[bucket(load)] = measured.lead(typical) < 1
        drafting = any(out)
        if drafting:
            self.ask = max(out)
        if self._probing is not None:  # a spell just ended: did it change the choice?
            same = measured is not None and self._probing == drafting
            self.backoff = min(2 * self.backoff, MAX_BACKOFF) if same else 1
            self._probing = None
        self.plain_steps = 0 if drafting else self.plain_steps + 1
        self.drafting_steps = self.drafting_steps + 1 if drafting else 0
        return out

    def _own_size(self, n: int, load: int, measured: Measured | None) -> Measured | None:
        """What a drafting step of `n` sequences (running and waiting) at `load` is judged
        by: the figures measured nearest its own size, from it up to the load's, on the
        rule that drafting's lead over plain falls as the batch grows (a verify row rides
        nearly free in a small batch). NOTE: a wave's tail (at c=16, the last 2-8
        sequences) judged by the load's step times went plain in its last 5-9 steps,
        where 4 sequences draft 1.2x or more faster than plain."""
        for level in range(bucket(n), bucket(load)):
            figures = self.gate.measured_at(level)
            if figures is not None:
                return figures
        return measured

    def _inferred(self, load: int) -> Measured | None:
        """At a load never measured, the figures of the nearest heavier load where
        drafting measured ahead: a lead here is at least that (same rule). NOTE: a load
        falling from 4 to 1 at c=1 spent 15-23 steps a bucket measuring plain there
        (plain in 24 % of the point's rounds, where drafting led by 1.26x)."""
        for level in sorted(b for b, v in self.behind.items() if b > bucket(load) and not v):
            figures = self.gate.measured_at(level)
            if figures is not None:
                return figures
        return None

    def _probe(self, batch: int, measured: bool, inferred: bool = False,
               size: int | None = None) -> None:
        """Start a probe spell when one is due: the other mode, measured again at the
        load `batch`; none at a load whose figures are `inferred` (a heavier load's
        probes keep them), and no plain one in a step whose `size` (running and
        waiting) is a lighter bucket's: a wave's tail, whose plain steps would stand for
        the load's (and drafting leads there)."""
        if self.spell[0] or inferred:
            return
        # NOTE: drafting unmeasured at this load is probed at once, unless drafting
        # measured behind plain at a lighter load: a verify row rides nearly free in a
        # small batch and costs a decode row's share in a compute-bound one, so the lead
        # falls with load (c=64 after c=32: that first probe flushed 64 sequences' rows,
        # ~10 % of the point). The periodic probe below still corrects a wrong guess.
        unmeasured = self.gate.count(batch, True) < GATE_MIN and \
            not any(v for b, v in self.behind.items() if b < bucket(batch))
        if unmeasured and self.plain_steps >= SPELL + GATE_MIN or \
                self.plain_steps >= EXPLORE_AFTER * self.backoff and \
                self.plain_s * FLUSH_SHARE >= self.flush_s:  # NOTE: load may fall
            self.plain_steps, self.spell, self._probing = 0, (SPELL + 1, True), False
            self._spell_steps, self._spell_level = 0, bucket(batch)
            return
        if not self.drafting_steps or size is not None and bucket(size) < bucket(batch):
            return
        if self.gate.count(batch, False) < GATE_MIN:  # plain never measured here: soon,
            # at once if drafting is (NOTE: else the model decides meanwhile, and at c=64
            # on an idle box it drafted in 1118 of 5490 rows where plain was fastest)
            period = 1 if self.gate.count(batch, True) >= GATE_MIN else SPELL + GATE_MIN
        elif measured and self.lead >= CLEAR_LEAD:
            period = PROBE_PLAIN_AFTER
        else:
            period = min(PROBE_SOON * self.backoff, PROBE_PLAIN_AFTER)
        if self.drafting_steps >= period:  # and plain, without drafter traffic
            self.drafting_steps, self.spell, self._probing = 0, (SPELL, False), True
            self._spell_steps, self._spell_level = 0, bucket(batch)

    def observe_round(self, key: Hashable, num_drafts: int, accepted: int) -> None:
        if num_drafts == 0:
            return
        counts = self.seqs.setdefault(key, PositionCounts.empty(self.num_steps))
        counts.record(num_drafts, accepted, SEQ_DECAY)
        self.global_counts.record(num_drafts, accepted, GLOBAL_DECAY)

    def observe_step(self, rows: int, forward_s: float, overhead_s: float, draft_s: float,
                     asked: bool, prompt_rows: bool = False,
                     started_s: float | None = None, batch: int = 0,
                     verified: bool = False, idle_after: bool = False,
                     drafter_busy: bool = False, depth: int = 0) -> None:
        """A step ran `rows` rows in `forward_s`; `overhead_s`: its other work but the
        drafter's; `draft_s`: its time in the drafter client (the wait for drafts, and
        an in-process drafter's round); `asked`: it asked for drafts; `prompt_rows`: it
        sent the drafter prompt rows; `started_s` (perf_counter), when given, adds the
        time until the next step starts to this step's overhead: a server's threads
        (streaming, the RPC server) take it from every step, more per step than the
        step itself on a busy host. NOTE: a remote round's wait falls in the step after
        the one that asked, so both steps' flags qualify a sample. `batch`, `verified`:
        its verify windows, whether it verified drafts (the gate's sample, with `rows`
        and `started_s`); `idle_after`: nothing was left to run after it, so the time to
        the next step is idle, not its cost (no gate sample); `drafter_busy`: a batch
        sent to the drafter is unanswered (no plain sample); `depth`: the draft steps its
        round was asked for (0: K)."""
        if rows > 0:
            self.forward.add(rows, forward_s)
        asked_before, prompt_before = self._last
        if started_s is None:
            self._overheads(asked).append(max(0.0, overhead_s))
        else:
            if self._open is not None:  # NOTE: idle waits count too; the median sees past
                start, busy, overhead, was_asked, sample, verified_then, idle = self._open
                self._overheads(was_asked).append(overhead + max(0.0, started_s - start - busy))
                # NOTE: an idle wait is no plain running: counted, a served stack idle
                # between a benchmark's repeats (other stacks' turns) had its flush repaid
                ran = min(busy, started_s - start) if idle else started_s - start
                self.plain_s = 0.0 if was_asked else self.plain_s + ran
                if sample is not None:
                    self.gate.add(*sample, started_s - start, verified_then)
            # NOTE: a drafting step asks for drafts and waits for the ones two drafting
            # steps asked for, drafts in hand or not: a round past its deadline (a step that
            # waited, then decoded plain) is drafting's cost too. The first rounds after a
            # plain spell (the held rows' flush) are not typical, and are left out.
            kind = True if asked and asked_before and self._asked_earlier else \
                False if not (asked or asked_before or verified) else None
            if asked:
                self._asked_s = started_s
            self._since_asked = 0 if asked else self._since_asked + 1
            # NOTE: and not within SETTLE steps, whatever the flush took: at c=64 on an
            # idle box plain steps after drafting took 80, 73, 57, 57, 48, 34, 37, 31 ms,
            # then 17-26 (the drafter's backlog, the finished requests' prompts); a spell
            # measured plain at 48 ms, and the gate drafted where plain was fastest
            # NOTE: nor while a drafter batch is unanswered: the first plain spell at c=64
            # after drafting at c=1..4 ran while the drafter worked off 64 sequences' held
            # rows (a second and more); its steps, 54 ms against a settled 19, were the
            # gate's only plain samples there, drafting measured 1.5-2.5x ahead, and the
            # stack drafted 188 of 221 steps where plain was 1.3x faster
            self._backlog = kind is False and (started_s - self._asked_s < 2 * self.flush_s
                                               or self._since_asked <= SETTLE or drafter_busy)
            if self._backlog:
                kind = None  # NOTE: the drafter still works off the last rounds: it takes
                # the host's cores from plain steps (at c=64, +60 % on plain's median)
            load = max(1, round(self.load or batch))
            sample = None if kind is None or idle_after or not batch else (load, kind, rows)
            if asked and not asked_before:  # a switch: the held rows go now
                self._flush_started = started_s
            elif kind and self._flush_started is not None:
                self.flush_s, self._flush_started = started_s - self._flush_started, None
            self._open = (started_s, forward_s + overhead_s + draft_s, max(0.0, overhead_s),
                          asked, sample, verified, idle_after)
        if asked or asked_before:
            timed = (draft_s, depth or self.num_steps)
            self.rounds.append(timed)
            if not (prompt_rows or prompt_before):
                self.clean_rounds.append(timed)
        self._last, self._asked_earlier = (asked, prompt_rows), asked_before

    def _overheads(self, asked: bool) -> deque:
        return self.overheads if asked else self.plain_overheads

    def forget(self, key: Hashable) -> None:
        self.seqs.pop(key, None)

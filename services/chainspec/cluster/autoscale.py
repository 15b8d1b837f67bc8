"""Drafter autoscaling: the policy, what the verifiers measure, and the decision rule.

Pure and clock-driven (the caller passes `now`), so the rule is tested without Ray; the
controller (`cluster/controller.py`) samples the signals, feeds them here and applies a
decision by changing the desired drafter count, which its reconcile loop starts or drains
(scale-in drains, never kills).

The rule, each interval:
- **occupancy**: running sequences (what the verifiers want drafted) per drafter, against
  one drafter's capacity (`drafter_max_seqs`). It recommends the fewest drafters that keep
  occupancy at or under `target_occupancy`.
- **draft wait**: the mean time a speculative round waited for drafts since the last
  sample. Above `draft_wait_high_s` it recommends one drafter more than now; between low
  and high it vetoes any scale-in (drafts are not clearly cheap yet).
- **hysteresis** (the rule of Kubernetes' HPA stabilization windows): scale out only when
  every recommendation of the last `up_window_s` is above the current count, to the lowest
  of them; scale in only when every one of the last `down_window_s` is below it, to the
  highest. While a change is in flight (drafters starting or draining) nothing is decided
  and the windows start again once it settled; nothing within `cooldown_s` of the last
  decision, whose wall time is stored so that the cooldown survives a controller restart.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

from chainspec.spine.read import validate
from chainspec.spine.sections import AutoscaleSection
from chainspec.spine.sections import default as spine_default

SPEC = re.compile(r"auto:(\d+)-(\d+)")


@dataclass(frozen=True)
class AutoscalePolicy:
    """Each field's type, default, bounds and meaning: the spine's AutoscaleSection."""

    min_drafters: int = spine_default(AutoscaleSection, "min_drafters")
    max_drafters: int = spine_default(AutoscaleSection, "max_drafters")
    target_occupancy: float = spine_default(AutoscaleSection, "target_occupancy")
    draft_wait_high_s: float = spine_default(AutoscaleSection, "draft_wait_high_s")
    draft_wait_low_s: float = spine_default(AutoscaleSection, "draft_wait_low_s")
    up_window_s: float = spine_default(AutoscaleSection, "up_window_s")
    down_window_s: float = spine_default(AutoscaleSection, "down_window_s")
    cooldown_s: float = spine_default(AutoscaleSection, "cooldown_s")
    interval_s: float = spine_default(AutoscaleSection, "interval_s")

    def __post_init__(self) -> None:
        validate(AutoscaleSection, dataclasses.asdict(self), "drafter.autoscale")
        if not 0 <= self.min_drafters <= self.max_drafters or self.max_drafters < 1:
            raise ValueError(f"autoscale needs 0 <= min_drafters <= max_drafters and "
                             f"max_drafters >= 1, got {self.min_drafters}-{self.max_drafters}")
        if not 0 < self.target_occupancy <= 1:
            raise ValueError(f"target_occupancy must be in (0, 1], got {self.target_occupancy}")
        if not 0 <= self.draft_wait_low_s <= self.draft_wait_high_s:
            raise ValueError("autoscale needs 0 <= draft_wait_low_s <= draft_wait_high_s")
        if min(self.up_window_s, self.down_window_s, self.cooldown_s) < 0 \
                or self.interval_s <= 0:
            raise ValueError("autoscale windows and cooldown must be >= 0, interval_s > 0")

    @classmethod
    def parse(cls, spec: str) -> AutoscalePolicy:
        """`auto:MIN-MAX` (the `--drafters` form), other fields the defaults."""
        match = SPEC.fullmatch(spec.strip())
        if match is None:
            raise ValueError(f"expected a drafter count or auto:MIN-MAX (e.g. auto:1-4), "
                             f"got {spec!r}")
        return cls(min_drafters=int(match[1]), max_drafters=int(match[2]))

    @classmethod
    def from_dict(cls, data: Any) -> AutoscalePolicy:
        return cls(**dict(validate(AutoscaleSection, data, "drafter.autoscale")))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def spec(self) -> str:
        return f"auto:{self.min_drafters}-{self.max_drafters}"

    def clamp(self, n: int) -> int:
        return min(max(n, self.min_drafters), self.max_drafters)


@dataclass(frozen=True)
class Signals:
    """One sample of what the verifiers and the controller see."""

    drafters: int  # drafters serving (ready, not draining)
    in_flight: int  # drafters starting or draining: a change not finished yet
    sequences: int  # running sequences on the verifiers (each wants drafts)
    capacity: int  # sequences one drafter holds (drafter_max_seqs)
    draft_wait_s: float | None  # mean wait per speculative round since the last sample

    @property
    def occupancy(self) -> float:
        """Sequences per serving drafter against its capacity (inf: demand, no drafter)."""
        if self.drafters == 0:
            return math.inf if self.sequences else 0.0
        return self.sequences / (self.drafters * self.capacity)

    def to_dict(self) -> dict[str, Any]:
        occupancy = self.occupancy
        return {**dataclasses.asdict(self),
                "occupancy": None if math.isinf(occupancy) else round(occupancy, 4)}


@dataclass(frozen=True)
class Decision:
    """A change of the desired drafter count, and why."""

    time: float  # wall clock (time.time()): cooldowns survive a controller restart
    before: int
    after: int
    kind: str  # what drove it: occupancy, draft_wait or bounds (a metric label)
    reason: str  # the same in words, with the numbers (the log line)
    signals: dict[str, Any]

    @property
    def direction(self) -> str:
        return "up" if self.after > self.before else "down"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "direction": self.direction}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        return cls(**{k: v for k, v in data.items() if k != "direction"})


def recommend(policy: AutoscalePolicy, s: Signals, current: int) -> tuple[int, str, str]:
    """The drafter count these signals ask for (clamped to the policy), what drove it
    (occupancy or draft_wait) and why in words."""
    per_drafter = s.capacity * policy.target_occupancy
    n = math.ceil(s.sequences / per_drafter) if s.sequences else 0
    kind, reason = "occupancy", (f"occupancy: {s.sequences} sequences need {n} drafter(s) "
                                 f"at {policy.target_occupancy:g} of {s.capacity} each")
    wait = s.draft_wait_s
    if wait is not None and wait > policy.draft_wait_high_s and n <= current:
        n, kind = current + 1, "draft_wait"
        reason = (f"draft wait {wait * 1e3:.1f} ms per round > "
                  f"{policy.draft_wait_high_s * 1e3:g} ms")
    elif wait is not None and wait >= policy.draft_wait_low_s and n < current:
        n, kind = current, "draft_wait"
        reason = (f"draft wait {wait * 1e3:.1f} ms per round >= "
                  f"{policy.draft_wait_low_s * 1e3:g} ms: no scale-in")
    if policy.clamp(n) != n:
        reason += f" (bounded to {policy.spec})"
    return policy.clamp(n), kind, reason


class Autoscaler:
    """The decision rule over time (module docstring). One per controller incarnation;
    `last` is the decision a previous incarnation stored, for its cooldown.

    Two clocks: `now` (monotonic) runs the windows and this incarnation's cooldown, so a
    stepped wall clock cannot fake a window; `wall` (time.time()) stamps decisions and
    turns a stored decision into the cooldown left (none if the wall clock went back)."""

    def __init__(self, policy: AutoscalePolicy, last: Decision | None = None) -> None:
        self.policy, self.last = policy, last
        self._recs: deque[tuple[float, int, str, str]] = deque()  # (time, n, kind, reason)
        self._since: float | None = None  # start of the current watch (windows need it)
        self._quiet_until: float | None = None  # monotonic end of the cooldown

    def observe(self, now: float, signals: Signals, current: int,
                wall: float | None = None) -> Decision | None:
        """Record one sample; a Decision when the desired count should change now."""
        p, wall = self.policy, now if wall is None else wall
        if self._since is None:
            self._since = now
            elapsed = wall - self.last.time if self.last is not None else p.cooldown_s
            self._quiet_until = now + max(0.0, p.cooldown_s - elapsed) if elapsed >= 0 \
                else now  # NOTE: the wall clock went back: the stored cooldown is over
        if p.clamp(current) != current:  # the bounds changed under a running stack
            return self._decide(now, wall, current, p.clamp(current), "bounds",
                                f"{current} drafters is outside {p.spec}", signals)
        if signals.in_flight:  # NOTE: samples before the change settles would overshoot
            self.rewatch(now)
            return None
        self._recs.append((now, *recommend(p, signals, current)))
        horizon = now - max(p.up_window_s, p.down_window_s)
        while self._recs and self._recs[0][0] < horizon:
            self._recs.popleft()
        if now < self._quiet_until:
            return None
        up = self._window(now, p.up_window_s)
        if up and all(r[1] > current for r in up):
            _, target, kind, why = min(up, key=lambda r: r[1])
            return self._decide(now, wall, current, target, kind, why, signals)
        down = self._window(now, p.down_window_s)
        if down and all(r[1] < current for r in down):
            _, target, kind, why = max(down, key=lambda r: r[1])
            return self._decide(now, wall, current, target, kind, why, signals)
        return None

    def rewatch(self, now: float) -> None:
        """Forget the recommendations: a whole window must be watched again from `now`
        (a change in flight, or a sample that could not see every verifier)."""
        self._recs.clear()
        if self._since is not None:
            self._since = now

    def _window(self, now: float, span: float) -> list[tuple[float, int, str, str]]:
        """The recommendations of the last `span` seconds, once the rule has watched that
        long (a fresh rule, e.g. after a restart, waits out a whole window first)."""
        if now - self._since < span:
            return []
        return [rec for rec in self._recs if rec[0] >= now - span]

    def _decide(self, now: float, wall: float, before: int, after: int, kind: str,
                reason: str, signals: Signals) -> Decision:
        self.last = Decision(wall, before, after, kind, reason, signals.to_dict())
        self._recs.clear()
        self._since, self._quiet_until = now, now + self.policy.cooldown_s
        return self.last

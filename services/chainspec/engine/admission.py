"""Fair admission: which waiting sequence runs next, and which running one gives way.

A **party** is the client request a sequence serves: the n choices of one request share
one (`Admission.party`, the gateway sends the request's own id), any other request is its
own party. The rules, in order:
- **priority** (policy `priority`, vLLM's): a lower value is admitted first. Under `fcfs`
  every request has priority 0 (a non-zero one is refused where it enters).
- **fair share**: among equal priorities, the party holding the fewest running sequences
  goes first, so a waiting probe never queues behind another party's n choices.
- **arrival**: then the waiting list's order (preempted sequences keep their place in
  front).
While a party waits with a free slot denied, a party of no better priority holding two or
more sequences more than it gives way: its newest sequence is preempted (by recompute,
invisible to its client). So, while others wait, no party holds more than half of
`max_seqs` (rounded up). Each preemption lowers the sum of squared holdings, so the loop
ends; once shares are within one of each other, nothing more is preempted.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from chainspec.engine.request import Request


class SchedulingPolicy(enum.StrEnum):
    FCFS = "fcfs"  # every request has priority 0
    PRIORITY = "priority"  # lower Admission.priority first (vLLM's --scheduling-policy)


@dataclass(frozen=True)
class Admission:
    """How one request is admitted (Verifier.Generate `priority`, `parent_request_id`)."""

    priority: int = 0  # lower is served first; non-zero needs SchedulingPolicy.PRIORITY
    party: str | None = None  # the client request it is a choice of; None: its own


OWN_PARTY = Admission()  # priority 0, a party of its own


def check_priority(priority: int, policy: SchedulingPolicy) -> None:
    """vLLM's rule: a priority other than 0 needs the priority policy (ValueError)."""
    if priority and policy is not SchedulingPolicy.PRIORITY:
        raise ValueError(f"priority {priority} needs --scheduling-policy priority "
                         f"(this verifier schedules {policy})")


def holdings(running: Sequence[Request]) -> Counter[str]:
    """Running (unfinished) sequences per party."""
    return Counter(r.party for r in running if not r.finished)


def next_admission(waiting: Sequence[Request], running: Sequence[Request]
                   ) -> Request | None:
    """The waiting request to admit next (priority, then fewest held, then arrival)."""
    held = holdings(running)
    candidates = [(r.priority, held[r.party], i) for i, r in enumerate(waiting)
                  if not r.finished]
    return waiting[min(candidates)[2]] if candidates else None


def fair_victim(waiting: Sequence[Request], running: Sequence[Request]) -> Request | None:
    """The running sequence to preempt for the next waiting one, or None.

    Call when no slot is free: the victim is the newest sequence of the party holding
    the most, if that party holds at least two more than the waiting one's and its
    priority is no better."""
    nxt = next_admission(waiting, running)
    if nxt is None:
        return None
    held = holdings(running)
    # NOTE: a party's sequences share one priority (the n choices of one request)
    rivals = [r for r in running if not r.finished and r.party != nxt.party and
              r.priority >= nxt.priority and held[r.party] > held[nxt.party] + 1]
    if not rivals:
        return None
    most = max(held[r.party] for r in rivals)
    return next(r for r in reversed(rivals) if held[r.party] == most)  # the newest

"""The controller's drafter autoscaler: samples what the verifiers measure, runs the rule
of `cluster/autoscale.py`, and hands each decision to the controller, which stores it in
its intent (GCS KV) before acting, then starts or drains drafters through its reconcile.

Signals, each interval: drafters serving / in flight (starting, draining) from the
controller's membership; running sequences and the cumulative draft wait (seconds and
rounds) from each ready verifier's `stats`, turned into the mean wait per round since the
previous sample (per verifier process: a restarted one starts a new baseline). A sample
in which a ready verifier does not answer in time is not used, and the rule watches its
windows again: demand it cannot see is not zero demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from chainspec.cluster.autoscale import AutoscalePolicy, Autoscaler, Decision, Signals
from chainspec.cluster.membership import Member, MemberState

log = logging.getLogger(__name__)
# a change not finished yet; a DEAD drafter is neither serving nor in flight: its load moves
# to the others, and if Ray never brings it back, autoscaling must not wait for it forever
IN_FLIGHT = (MemberState.STARTING, MemberState.DRAINING)


class AutoscaleLoop:
    """One task per policy; `restart` after the policy changes (or the controller
    recovered). `apply` gets each decision, `observed` each complete sample."""

    def __init__(self, members: Callable[[], list[Member]], handle: Callable[[str], Any],
                 capacity: int, timeout_s: float, apply: Callable[[Decision], None],
                 observed: Callable[[Signals], None] = lambda s: None) -> None:
        self._members, self._handle, self._apply = members, handle, apply
        self._observed = observed
        self.capacity, self.timeout_s = capacity, timeout_s
        self.latest: Signals | None = None
        self._task: asyncio.Task | None = None
        self._waits: dict[str, tuple[Any, float, float]] = {}  # verifier -> (pid, s, rounds)

    def restart(self, policy: AutoscalePolicy | None, last: Decision | None,
                current: Callable[[], int]) -> None:
        self.stop()
        if policy is not None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(Autoscaler(policy, last), current))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self, scaler: Autoscaler, current: Callable[[], int]) -> None:
        while True:
            await asyncio.sleep(scaler.policy.interval_s)
            try:
                signals = await self.sample()
                if signals is None:  # NOTE: unseen demand is not zero demand
                    scaler.rewatch(time.monotonic())
                    continue
                self.latest = signals
                self._observed(signals)
                decision = scaler.observe(time.monotonic(), signals, current(), time.time())
                if decision is not None:
                    self._apply(decision)
            except Exception:  # NOTE: a bad sample must not end autoscaling for good
                log.exception("drafter autoscaler: sample failed")

    async def sample(self) -> Signals | None:
        """This interval's signals; None when the verifiers cannot all be seen (a ready
        one did not answer, or there are verifiers and none is ready)."""
        members = self._members()
        drafters = [m for m in members if m.role == "drafter"]
        verifiers = [m for m in members
                     if m.role == "verifier" and m.state is MemberState.READY]
        if not verifiers and any(m.role == "verifier" for m in members):
            return None
        stats = await asyncio.gather(*(self._stats(m) for m in verifiers))
        if any(s is None for s in stats):
            return None
        ids = {m.member_id for m in verifiers}  # NOTE: no baseline outlives its verifier
        self._waits = {k: v for k, v in self._waits.items() if k in ids}
        sequences, wait_s, rounds = 0, 0.0, 0.0
        for member, s in zip(verifiers, stats, strict=True):
            sequences += int(s.get("running", 0))
            now = (s.get("pid"), float(s.get("draft_wait_s_total", 0.0)),
                   float(s.get("draft_waits", 0)))
            before = self._waits.get(member.member_id)
            self._waits[member.member_id] = now
            # NOTE: a restarted verifier (new pid) counts from 0: no interval this time
            if before is None or before[0] != now[0] or now[2] < before[2] \
                    or now[1] < before[1]:
                continue
            wait_s, rounds = wait_s + now[1] - before[1], rounds + now[2] - before[2]
        return Signals(
            drafters=sum(m.state is MemberState.READY for m in drafters),
            in_flight=sum(m.state in IN_FLIGHT for m in drafters),
            sequences=sequences, capacity=self.capacity,
            draft_wait_s=wait_s / rounds if rounds else None)

    async def _stats(self, member: Member) -> dict[str, Any] | None:
        with contextlib.suppress(Exception):  # restarting, hung, gone: not this sample
            return await asyncio.wait_for(self._handle(member.member_id).stats.remote(),
                                          self.timeout_s)
        return None

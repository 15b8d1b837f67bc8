"""The controller's health monitor (`Controller._monitor`) on a fake member handle: a
ready member that misses one ping is dead at once; a starting member (still importing or
loading, so it cannot answer) is given `start_timeout_s`, then its silence makes it dead
with the reason; an answer brings it back."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from chainspec.cluster.config import StackConfig
from chainspec.cluster.controller import Controller
from chainspec.cluster.membership import Member, MemberState


class Handle:
    """An actor handle whose ping hangs until `answer` is set."""

    def __init__(self) -> None:
        self.answer: dict | None = None
        self.ping = SimpleNamespace(remote=self._ping)

    async def _ping(self) -> dict:
        while self.answer is None:
            await asyncio.sleep(0.01)
        return self.answer


def _controller(member: Member, handle: Handle, start_timeout_s: float):
    config = StackConfig(health_interval_s=0.01, health_timeout_s=0.05,
                         start_timeout_s=start_timeout_s)
    return SimpleNamespace(config=config, _handles={member.member_id: handle},
                           _members={member.member_id: member}, _bump=lambda: None)


def _states(member: Member, controller, handle: Handle, at: list[float],
            answer_at: float | None = None) -> list[MemberState]:
    async def main() -> list[MemberState]:
        task = asyncio.ensure_future(Controller._monitor(controller, member))
        seen, t = [], 0.0
        for when in at:
            await asyncio.sleep(when - t)
            t = when
            if answer_at is not None and t >= answer_at and handle.answer is None:
                handle.answer = {"serving": True, "endpoint": "h:1", "load": 0, "pid": 7,
                                 "node": "n", "error": None}
                await asyncio.sleep(0.1)
            seen.append(member.state)
        controller._members.clear()
        await asyncio.wait_for(task, 2)
        return seen
    return asyncio.run(main())


def test_a_silent_starting_member_is_dead_only_after_the_start_timeout() -> None:
    member, handle = Member("drafter-1", "drafter"), Handle()
    controller = _controller(member, handle, start_timeout_s=0.5)
    seen = _states(member, controller, handle, at=[0.3, 0.9])
    assert seen == [MemberState.STARTING, MemberState.DEAD]
    assert "while starting" in member.error


def test_a_late_answer_brings_the_member_back() -> None:
    member, handle = Member("drafter-1", "drafter"), Handle()
    controller = _controller(member, handle, start_timeout_s=0.3)
    seen = _states(member, controller, handle, at=[0.6, 0.7], answer_at=0.7)
    assert seen == [MemberState.DEAD, MemberState.READY]


def test_a_ready_member_that_misses_a_ping_is_dead_at_once() -> None:
    member, handle = Member("verifier-0", "verifier", state=MemberState.READY), Handle()
    controller = _controller(member, handle, start_timeout_s=300.0)
    seen = _states(member, controller, handle, at=[0.2])
    assert seen == [MemberState.DEAD] and "missed a health check" in member.error

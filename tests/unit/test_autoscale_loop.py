"""The autoscaler's sampling (cluster/autoscale_loop.py) over fake members and actor
handles: running sequences summed over ready verifiers, the draft wait per round as the
difference of cumulative counters between samples (a restarted verifier's reset counters
are not a negative wait), silent verifiers left out, and which drafters count as serving
or in flight."""

from __future__ import annotations

import asyncio

import pytest

from chainspec.cluster.autoscale_loop import AutoscaleLoop
from chainspec.cluster.membership import Member, MemberState


class Remote:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self):
        async def call():
            return self.fn()
        return call()


class Handle:
    def __init__(self) -> None:
        self.answer: dict | None = {}
        self.stats = Remote(self._stats)

    def _stats(self):
        if self.answer is None:
            raise RuntimeError("actor died")
        return self.answer


def member(member_id: str, state: MemberState = MemberState.READY) -> Member:
    return Member(member_id, member_id.rsplit("-", 1)[0], state=state)


def loop_of(members: list[Member], handles: dict[str, Handle]) -> AutoscaleLoop:
    return AutoscaleLoop(lambda: members, handles.__getitem__, capacity=8, timeout_s=1.0,
                         apply=lambda d: None)


def sample(loop: AutoscaleLoop):
    return asyncio.run(loop.sample())


def test_sequences_and_draft_wait_per_round_over_verifiers():
    handles = {"verifier-0": Handle(), "verifier-1": Handle()}
    members = [member("verifier-0"), member("verifier-1"), member("drafter-0"),
               member("drafter-1", MemberState.STARTING),
               member("drafter-2", MemberState.DRAINING), member("drafter-3", MemberState.DEAD)]
    loop = loop_of(members, handles)
    handles["verifier-0"].answer = {"running": 5, "draft_wait_s_total": 1.0, "draft_waits": 100}
    handles["verifier-1"].answer = {"running": 3, "draft_wait_s_total": 2.0, "draft_waits": 50}
    first = sample(loop)
    assert (first.sequences, first.capacity) == (8, 8)
    assert first.draft_wait_s is None  # no earlier sample: no interval yet
    assert (first.drafters, first.in_flight) == (1, 2)  # the dead one is neither
    handles["verifier-0"].answer = {"running": 6, "draft_wait_s_total": 1.3, "draft_waits": 110}
    handles["verifier-1"].answer = {"running": 2, "draft_wait_s_total": 2.5, "draft_waits": 60}
    second = sample(loop)
    # (0.3 + 0.5) s over (10 + 10) rounds
    assert second.draft_wait_s == pytest.approx(0.04) and second.sequences == 8


def test_a_restarted_verifier_and_a_silent_one():
    handles = {"verifier-0": Handle(), "verifier-1": Handle()}
    members = [member("verifier-0"), member("verifier-1"), member("drafter-0")]
    loop = loop_of(members, handles)
    handles["verifier-0"].answer = {"running": 4, "draft_wait_s_total": 9.0, "draft_waits": 900}
    handles["verifier-1"].answer = {"running": 4, "draft_wait_s_total": 1.0, "draft_waits": 100}
    sample(loop)
    # verifier-0 restarted (counters from 0); verifier-1 does not answer
    handles["verifier-0"].answer = {"running": 1, "draft_wait_s_total": 0.2, "draft_waits": 10}
    handles["verifier-1"].answer = None
    s = sample(loop)
    assert s.sequences == 1 and s.draft_wait_s is None  # no usable interval, never negative
    handles["verifier-0"].answer = {"running": 1, "draft_wait_s_total": 0.5, "draft_waits": 20}
    handles["verifier-1"].answer = {"running": 2, "draft_wait_s_total": 1.1, "draft_waits": 110}
    s = sample(loop)
    # verifier-0: 0.3 s / 10 rounds since its restart; verifier-1: 0.1 s / 10 since its last
    assert s.draft_wait_s == pytest.approx(0.02) and s.sequences == 3


def test_only_ready_verifiers_are_asked():
    handles = {"verifier-0": Handle()}
    members = [member("verifier-0", MemberState.STARTING), member("drafter-0")]
    handles["verifier-0"].answer = {"running": 7}
    s = sample(loop_of(members, handles))
    assert s.sequences == 0 and s.drafters == 1

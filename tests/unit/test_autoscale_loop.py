"""The autoscaler's sampling (cluster/autoscale_loop.py) over fake members and actor
handles: running sequences summed over ready verifiers, the draft wait per round as the
difference of cumulative counters between samples (a restarted verifier's reset counters
are not a negative wait), silent verifiers left out, and which drafters count as serving
or in flight."""

from __future__ import annotations

import asyncio
import time

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


def test_a_restarted_verifier_starts_a_new_baseline():
    """Keyed by process: a restart whose new counters already passed the old ones must
    not read as a (negative) wait."""
    handles = {"verifier-0": Handle()}
    loop = loop_of([member("verifier-0"), member("drafter-0")], handles)
    handles["verifier-0"].answer = {"pid": 10, "running": 4, "draft_wait_s_total": 3.0,
                                    "draft_waits": 10}
    sample(loop)
    handles["verifier-0"].answer = {"pid": 11, "running": 1, "draft_wait_s_total": 0.2,
                                    "draft_waits": 40}
    assert sample(loop).draft_wait_s is None  # a new process: a new baseline
    handles["verifier-0"].answer = {"pid": 11, "running": 1, "draft_wait_s_total": 0.5,
                                    "draft_waits": 50}
    assert sample(loop).draft_wait_s == pytest.approx(0.03)


def test_a_sample_missing_a_ready_verifier_is_not_used():
    """Demand the loop cannot see is not zero demand: no Signals at all."""
    handles = {"verifier-0": Handle(), "verifier-1": Handle()}
    members = [member("verifier-0"), member("verifier-1"), member("drafter-0")]
    loop = loop_of(members, handles)
    handles["verifier-0"].answer = {"running": 4}
    handles["verifier-1"].answer = None  # dead or too busy to answer in time
    assert sample(loop) is None
    restarting = [member("verifier-0", MemberState.STARTING), member("drafter-0")]
    assert sample(loop_of(restarting, handles)) is None
    no_verifiers = sample(loop_of([member("drafter-0")], {}))
    assert no_verifiers.sequences == 0  # a stack scaled to 0 verifiers has no demand


def test_the_run_loop_never_scales_in_on_verifiers_it_cannot_see():
    """Through `_run`: verifiers silent for longer than the down window cause no scale-in
    (read as zero demand, they would); once they answer with no load, the window is
    watched whole again; every usable sample reaches `observed` (the gauges)."""
    from chainspec.cluster.autoscale import AutoscalePolicy

    handles = {"verifier-0": Handle()}
    seen, applied = [], []
    loop = AutoscaleLoop(lambda: [member("verifier-0"), member("drafter-0")],
                         handles.__getitem__, capacity=4, timeout_s=1.0,
                         apply=applied.append, observed=seen.append)
    policy = AutoscalePolicy(min_drafters=1, max_drafters=3, down_window_s=0.3,
                             cooldown_s=0.0, interval_s=0.02)
    handles["verifier-0"].answer = None
    restored = []

    async def go():
        loop.restart(policy, None, lambda: 3)
        await asyncio.sleep(0.8)  # > 2 down windows without a usable sample
        assert applied == [] and seen == []
        handles["verifier-0"].answer = {"running": 0}
        restored.append(time.time())
        await asyncio.sleep(1.5)
        loop.stop()
    asyncio.run(go())
    assert [(d.before, d.after) for d in applied][:1] == [(3, 1)]
    assert applied[0].time - restored[0] >= 0.3 - 0.05  # a whole window after
    assert seen and all(s.sequences == 0 for s in seen)


def test_only_ready_verifiers_are_asked():
    """A starting verifier is not asked (it serves nothing yet) and does not spoil the
    sample while another is ready."""
    handles = {"verifier-0": Handle(), "verifier-1": Handle()}
    members = [member("verifier-0", MemberState.STARTING), member("verifier-1"),
               member("drafter-0")]
    handles["verifier-0"].answer = {"running": 7}
    handles["verifier-1"].answer = {"running": 2}
    s = sample(loop_of(members, handles))
    assert s.sequences == 2 and s.drafters == 1

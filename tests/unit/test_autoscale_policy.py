"""The drafter autoscaling rule (cluster/autoscale.py), on a fake clock: what each signal
recommends, hysteresis windows, cooldowns that survive a restart, bounds, in-flight
changes; and the config/flag forms of a policy."""

from __future__ import annotations

import argparse
import math

import pytest

from chainspec.cluster.autoscale import AutoscalePolicy, Autoscaler, Decision, Signals, recommend
from chainspec.cluster.config import DrafterRoleConfig, StackConfig
from chainspec.commands.stack_flags import drafter_count, merge, stack_overrides

POLICY = AutoscalePolicy(min_drafters=1, max_drafters=4, target_occupancy=0.5,
                         draft_wait_high_s=0.02, draft_wait_low_s=0.005, up_window_s=2.0,
                         down_window_s=5.0, cooldown_s=3.0, interval_s=1.0)


def sig(sequences: int, drafters: int = 1, wait: float | None = None,
        in_flight: int = 0) -> Signals:
    return Signals(drafters=drafters, in_flight=in_flight, sequences=sequences, capacity=8,
                   draft_wait_s=wait)


def run(scaler: Autoscaler, samples, current: int, start: float = 0.0):
    """Feed one sample a second; apply each decision to `current`. -> decisions."""
    out = []
    for i, s in enumerate(samples):
        d = scaler.observe(start + i, s, current)
        if d is not None:
            out.append(d)
            current = d.after
    return out


def test_occupancy_recommends_the_fewest_drafters_under_the_target():
    # capacity 8 at 0.5 -> 4 sequences per drafter
    assert [recommend(POLICY, sig(n), 1)[0] for n in (0, 1, 4, 5, 12, 13, 100)] == \
        [1, 1, 1, 2, 3, 4, 4]  # clamped to [1, 4]
    n, kind, reason = recommend(POLICY, sig(100), 1)
    assert kind == "occupancy" and "bounded to auto:1-4" in reason


def test_draft_wait_adds_one_above_high_and_vetoes_scale_in_between():
    assert recommend(POLICY, sig(1, wait=0.05), 2)[:2] == (3, "draft_wait")
    assert recommend(POLICY, sig(1, wait=0.01), 3)[:2] == (3, "draft_wait")  # no scale-in
    assert recommend(POLICY, sig(1, wait=0.001), 3)[:2] == (1, "occupancy")
    assert recommend(POLICY, sig(1, wait=None), 3)[:2] == (1, "occupancy")  # no rounds
    # occupancy already asks for more than +1: it wins
    assert recommend(POLICY, sig(16, wait=0.05), 1)[:2] == (4, "occupancy")


def test_scale_out_waits_for_a_whole_window_of_higher_recommendations():
    scaler = Autoscaler(POLICY)
    # a one-sample spike does not scale
    assert run(scaler, [sig(1), sig(1), sig(1), sig(12), sig(1), sig(1)], 1) == []
    scaler = Autoscaler(POLICY)
    decisions = run(scaler, [sig(12), sig(12), sig(8), sig(12)], 1)
    assert [(d.before, d.after, d.direction) for d in decisions] == [(1, 2, "up")]
    assert decisions[0].time == 2.0  # the window (2 s) had to be covered
    assert decisions[0].signals["sequences"] == 8  # the sample it was taken at


def test_scale_in_waits_longer_and_goes_to_the_highest_recent_recommendation():
    scaler = Autoscaler(POLICY)
    samples = [sig(8, drafters=4)] * 3 + [sig(0, drafters=4)] * 10
    decisions = run(scaler, samples, 4)
    # first to the max over the window (it still holds the 8-sequence samples), then,
    # a whole fresh window later, to what the idle samples ask for
    assert [(d.before, d.after) for d in decisions] == [(4, 2), (2, 1)]
    assert decisions[0].time == POLICY.down_window_s and decisions[0].direction == "down"
    assert decisions[1].time == decisions[0].time + POLICY.down_window_s
    scaler = Autoscaler(POLICY)
    assert run(scaler, [sig(0, drafters=4)] * 4, 4) == []  # window not yet covered


def test_no_decision_while_a_change_is_in_flight_or_in_cooldown():
    scaler = Autoscaler(POLICY)
    assert run(scaler, [sig(12, in_flight=1)] * 6, 1) == []
    scaler = Autoscaler(POLICY)
    first = run(scaler, [sig(30)] * 3, 1)
    assert [(d.before, d.after) for d in first] == [(1, 4)]
    # the same controller: nothing within the cooldown even if the load is gone
    assert run(scaler, [sig(0, drafters=4)] * 3, 4, start=3.0) == []


def test_a_restarted_rule_keeps_the_stored_cooldown_and_rewatches_its_windows():
    stored = Decision(100.0, 1, 4, "occupancy", "x", {})
    restored = Decision.from_dict(stored.to_dict())
    assert restored == stored
    scaler = Autoscaler(POLICY, last=restored)
    # 101..102: inside the cooldown (3 s) of the stored decision
    assert scaler.observe(101.0, sig(0, drafters=4), 4) is None
    # after the cooldown it must still watch a whole down window first
    decisions = run(scaler, [sig(0, drafters=4)] * 8, 4, start=102.0)
    assert [(d.before, d.after) for d in decisions] == [(4, 1)]
    assert decisions[0].time >= 101.0 + POLICY.down_window_s


def test_bounds_changed_under_a_running_stack_apply_at_once():
    d = Autoscaler(POLICY).observe(0.0, sig(0, drafters=6), 6)
    assert (d.before, d.after, d.kind) == (6, 4, "bounds")
    d = Autoscaler(AutoscalePolicy(min_drafters=2, max_drafters=3)).observe(0.0, sig(0), 1)
    assert (d.after, d.direction) == (2, "up")


def test_occupancy_without_drafters_is_infinite_and_min_zero_scales_from_zero():
    assert math.isinf(sig(3, drafters=0).occupancy)
    assert sig(3, drafters=0).to_dict()["occupancy"] is None  # JSON-safe
    zero = AutoscalePolicy(min_drafters=0, max_drafters=2, up_window_s=0, cooldown_s=0)
    d = Autoscaler(zero).observe(0.0, sig(3, drafters=0), 0)
    assert (d.before, d.after) == (0, 1)


@pytest.mark.parametrize("bad", [dict(min_drafters=3, max_drafters=2),
                                 dict(max_drafters=0, min_drafters=0),
                                 dict(target_occupancy=0.0), dict(target_occupancy=1.5),
                                 dict(draft_wait_low_s=0.1, draft_wait_high_s=0.01),
                                 dict(interval_s=0), dict(cooldown_s=-1)])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        AutoscalePolicy(**bad)


def test_policy_in_the_config_file_and_its_errors():
    c = StackConfig.from_dict({"drafter": {"autoscale": {"min_drafters": 2,
                                                         "max_drafters": 5}}})
    assert c.drafter.autoscale == AutoscalePolicy(min_drafters=2, max_drafters=5)
    assert c.drafter.replicas == 2  # starts at the minimum
    assert StackConfig.from_dict(c.to_dict()) == c  # round trip (the controller's copy)
    with pytest.raises(ValueError, match="unknown keys bogus"):
        StackConfig.from_dict({"drafter": {"autoscale": {"bogus": 1}}})
    with pytest.raises(ValueError, match="outside drafter.autoscale auto:2-5"):
        DrafterRoleConfig(replicas=7, autoscale={"min_drafters": 2, "max_drafters": 5})
    with pytest.raises(ValueError, match="needs drafter.mode remote"):
        DrafterRoleConfig(mode="local", autoscale={"max_drafters": 2})


def test_drafters_flag_takes_a_count_or_a_range_and_lays_over_the_file():
    assert drafter_count("3") == 3 and drafter_count("auto:1-4") == (1, 4)
    for bad in ("auto:4-1", "auto:1", "three", "auto:x-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            drafter_count(bad)
    file = {"drafter": {"autoscale": {"max_drafters": 9, "cooldown_s": 1.0}}}
    args = argparse.Namespace(**{"stack_drafter_replicas": (1, 3)})
    flags = _overrides(args)
    merged = StackConfig.from_dict(merge(file, flags))
    # the range replaces the bounds and keeps the file's other policy fields
    assert merged.drafter.autoscale == AutoscalePolicy(min_drafters=1, max_drafters=3,
                                                       cooldown_s=1.0)
    fixed = StackConfig.from_dict(merge(file, _overrides(argparse.Namespace(
        stack_drafter_replicas=2))))
    assert fixed.drafter.autoscale is None and fixed.drafter.replicas == 2
    # a file's count outside the flag's range: the flag's range starts at its minimum
    counted = {"drafter": {"replicas": 2}}
    ranged = StackConfig.from_dict(merge(counted, _overrides(argparse.Namespace(
        stack_drafter_replicas=(3, 6)))))
    assert (ranged.drafter.replicas, ranged.drafter.autoscale.spec) == (3, "auto:3-6")


def _overrides(partial: argparse.Namespace) -> dict:
    """stack_overrides of a namespace with only the given stack flags set."""
    from chainspec.commands.stack_flags import STACK_FLAGS

    values = {flag.dest: None for flag in STACK_FLAGS}
    values.update(vars(partial))
    values.update(token_file=None, token_env=None)
    return stack_overrides(argparse.Namespace(**values))


def test_samples_taken_while_a_change_is_in_flight_do_not_count():
    """1 -> 2 on draft wait; the new drafter takes 30 s to serve while the wait stays
    high: the next step waits a whole window after it serves, not one sample."""
    scaler = Autoscaler(POLICY)
    assert [(d.before, d.after) for d in run(scaler, [sig(1, wait=0.05)] * 3, 1)] == [(1, 2)]
    for t in range(3, 33):
        assert scaler.observe(float(t), sig(1, wait=0.05, in_flight=1), 2) is None
    assert scaler.observe(33.0, sig(1, drafters=2, wait=0.05), 2) is None  # serving now
    d = scaler.observe(34.0, sig(1, drafters=2, wait=0.05), 2)
    # a whole up window (2 s) after the last in-flight sample, on settled samples only
    assert (d.before, d.after, d.time) == (2, 3, 34.0)


def test_windows_follow_the_monotonic_clock_not_the_wall_clock():
    scaler = Autoscaler(POLICY)
    # the wall clock jumps an hour ahead between two samples: still one sample, no window
    assert scaler.observe(0.0, sig(12), 1, wall=1000.0) is None
    assert scaler.observe(1.0, sig(12), 1, wall=4600.0) is None
    d = scaler.observe(2.0, sig(12), 1, wall=4601.0)
    assert (d.after, d.time) == (3, 4601.0)  # decisions carry wall time (for a restart)
    # a stored decision "from the future" (the wall clock went back): no endless cooldown
    later = Autoscaler(POLICY, last=d)
    decisions = run(later, [sig(0, drafters=3)] * 7, 3, start=0.0)
    assert [(x.before, x.after, x.time) for x in decisions] == [(3, 1, 5.0)]

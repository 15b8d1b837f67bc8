"""Adaptive depth (DESIGN 4.11) where the step's size is not the load's: a wave's tail,
and a load falling to a size never measured. Drafting's lead over plain falls as the
batch grows, so a drafting stack judges a smaller step by the figures measured nearest
its own size, and a lighter load by a heavier one's where drafting led there.

Costs in milliseconds; gate figures are added by hand (`ModeGate.add`)."""

from chainspec.engine.adaptive_depth import GATE_MIN, PROBE_SOON, SPELL, AdaptiveDepth

GOOD = list(range(16))  # sequences whose drafts are all accepted (4 tokens a round)
HARD = [100, 101, 102, 103]  # no draft accepted (1.7 tokens a round, at the prior's pull)


def _policy() -> AdaptiveDepth:
    policy = AdaptiveDepth(num_steps=3)
    for _ in range(30):
        for seq in GOOD:
            policy.observe_round(seq, 3, 3)
        for seq in HARD:
            policy.observe_round(seq, 3, 0)
        policy.observe_step(16, 10.0, 0.0, 0.0, asked=True)  # verify rows ride nearly
        policy.observe_step(64, 11.0, 0.0, 0.0, asked=True)  # free: full depth
    return policy


def _measure(policy: AdaptiveDepth, batch: int, plain_ms: float, drafting_ms: float) -> None:
    for _ in range(GATE_MIN + 1):
        policy.gate.add(batch, True, 4 * batch, drafting_ms, verified=True)
        policy.gate.add(batch, False, batch, plain_ms)


def _wave() -> AdaptiveDepth:
    """At 16 sequences a drafting step takes 24 ms against plain's 10 (good sequences:
    3.8 x 10 / 24 = 1.6x plain; hard ones 1.7 x 10 / 24 = 0.71x); at 4 it takes 6 against
    4 (hard ones 1.7 x 4 / 6 = 1.13x). Drafting at a load of 16."""
    policy = _policy()
    _measure(policy, 16, plain_ms=10.0, drafting_ms=24.0)
    _measure(policy, 4, plain_ms=4.0, drafting_ms=6.0)
    policy.load = 16.0
    assert policy.depths(GOOD, [3] * 16, demand=16) == [3] * 16
    return policy


def test_a_waves_tail_is_judged_at_its_own_size():
    # the last 4 (the hard ones, which finish last) with nobody waiting: by 16's step
    # times plain leads (0.71 < 0.9, the hold bar); by 4's drafting does (1.13x)
    policy = _wave()
    assert policy.depths(HARD, [3] * 4, demand=4) == [3] * 4
    assert policy.lead > 1.1
    assert round(policy.load) == 15  # the load's mean is still the wave's


def test_four_verifying_while_twelve_wait_are_judged_at_the_load():
    # a ramp, not a tail: 16 sequences' steps follow, so 16's figures decide
    policy = _wave()
    assert policy.depths(HARD, [3] * 4, demand=16) == [0] * 4


def test_a_plain_stack_does_not_switch_at_a_tail():
    # plain at the load (hard sequences throughout): the tail stays plain; a switch to
    # drafting would flush every held row, so only the load's figures call it
    policy = _policy()
    _measure(policy, 16, plain_ms=10.0, drafting_ms=24.0)
    _measure(policy, 4, plain_ms=4.0, drafting_ms=6.0)
    policy.load = 16.0
    assert policy.depths(HARD * 4, [3] * 16, demand=16) == [0] * 16
    assert policy.depths(HARD, [3] * 4, demand=4) == [0] * 4


def _light() -> AdaptiveDepth:
    """Measured at 4 sequences only, drafting ahead there (good: 3.8 x 4 / 10 = 1.53x),
    then the load falls to one sequence."""
    policy = _policy()
    _measure(policy, 4, plain_ms=4.0, drafting_ms=10.0)
    policy.load = 4.0
    assert policy.depths(GOOD[:4], [3] * 4, demand=4) == [3] * 4
    policy.load = 1.0
    return policy


def test_a_lighter_load_than_one_where_drafting_led_drafts_without_probing_plain():
    # one sequence, never measured: drafting's lead here is at least 4's, so no plain
    # spell measures it (at c=1 they took 15-23 steps a bucket)
    policy = _light()
    chosen = [policy.depths([0], [3], demand=1)[0] for _ in range(4 * (SPELL + GATE_MIN))]
    assert chosen == [3] * len(chosen)
    # a hard prompt there still goes plain, by 4's figures (1.7 x 4 / 10 = 0.68), and
    # the next good one drafts again at once (1.53 > 1.05, the bar from plain)
    assert policy.depths([HARD[0]], [3], demand=1) == [0]
    assert policy.depths([0], [3], demand=1) == [3]


def test_a_lighter_load_than_one_where_drafting_lost_is_measured():
    # drafting measured behind at 4 (4 x 4 / 20 = 0.8): no inference; plain is probed
    # at 1 as before, after SPELL + GATE_MIN drafting steps
    policy = _policy()
    _measure(policy, 4, plain_ms=4.0, drafting_ms=20.0)
    policy.load = 4.0
    policy.depths(GOOD[:4], [3] * 4, demand=4)
    assert policy.behind[2]
    policy.load, policy.plain_steps, policy._probing = 1.0, 0, None
    chosen = [policy.depths([0], [3], demand=1)[0] for _ in range(SPELL + GATE_MIN + 2)]
    assert 0 in chosen


def test_no_plain_probe_starts_in_a_waves_tail():
    # two sequences left and nobody waiting, for longer than any probe period: a plain
    # spell here would time 2-sequence plain steps as the load's, and drafting leads
    policy = _wave()
    chosen = [policy.depths(GOOD[:2], [3] * 2, demand=2)[0] for _ in range(2 * PROBE_SOON)]
    assert chosen == [3] * len(chosen)


def test_a_plain_spell_ends_when_the_load_leaves_the_bucket_it_measures():
    # drafting measured at 16, plain not: a plain spell starts at once and runs on while
    # plain is unmeasured there
    policy = _policy()
    for _ in range(GATE_MIN + 1):
        policy.gate.add(16, True, 64, 24.0, verified=True)
    policy.load = 16.0
    assert policy.depths(GOOD, [3] * 16, demand=16) == [3] * 16
    assert all(policy.depths(GOOD, [3] * 16, demand=16) == [0] * 16 for _ in range(2 * SPELL))
    # the load's mean falls to 9, another bucket: the spell can measure nothing there
    policy.load = 9.0
    chosen = [policy.depths(GOOD[:9], [3] * 9, demand=9)[0] for _ in range(2)]
    assert chosen[-1] == 3

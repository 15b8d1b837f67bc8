"""Adaptive draft depth's decisions on hand-made estimates and costs (DESIGN 4.11).

Costs are in milliseconds (the policy only compares ratios). Each expected depth is
checked by hand from tokens/seconds in the test's comment."""

import itertools
import random

import pytest

from chainspec.engine.adaptive_depth import (
    EXPLORE_AFTER,
    GATE_MIN,
    MAX_BACKOFF,
    PROBE_PLAIN_AFTER,
    SETTLE,
    SPELL,
    SWITCH_MARGIN,
    AdaptiveDepth,
    Measured,
    PositionCounts,
    _LinearFit,
    bucket,
)
from chainspec.engine.depth_choice import StepCost, choose_depths, choose_round, expected_tokens

MS = StepCost(fixed_s=1.0, per_row_s=1.0)


def test_expected_tokens_is_bonus_plus_accepted_prefixes():
    assert expected_tokens([0.9, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.9, 0.5, 0.5], 2) == pytest.approx(1 + 0.9 + 0.45)
    assert expected_tokens([0.9, 0.5, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)


def test_batch_one_high_acceptance_drafts_full_depth():
    # plain 1/2 = .5; d1: 1.9/3 = .63; d2: 2.71/4 = .68; d3: 3.439/5 = .69
    assert choose_depths([[0.9] * 3], [3], MS) == [3]


def test_depth_stops_where_the_next_draft_no_longer_pays():
    # fixed 1, row 1: d1 1.8/3 = .6 > .5; d2 .64 * 3 = 1.92 > 1.8 -> 2.44/4 = .61;
    # d3 .512 * 4 = 2.05 < 2.44: stop at 2
    assert choose_depths([[0.8, 0.8, 0.8]], [3], MS) == [2]


def test_high_batch_drafts_less():
    # 16 rows: plain 16/17 = .94 tokens/ms; a first draft adds .6 for 1 ms: not worth it
    assert choose_depths([[0.6] * 3] * 16, [3] * 16, MS) == [0] * 16
    # the same rates at batch 1 pay: plain .5 < 1.6/3; a second (.36 * 3 < 1.6) does not
    assert choose_depths([[0.6] * 3], [3], MS) == [1]


def test_low_acceptance_drafts_nothing():
    # plain .5; one draft: 1.3/3 = .43
    assert choose_depths([[0.3] * 3], [3], MS) == [0]


def test_draft_round_cost_can_make_plain_best():
    # plain 1/2 = .5; best with drafts 3.439/(5 + 10) = .23
    cost = StepCost(fixed_s=1.0, per_row_s=1.0, draft_s=10.0)
    assert choose_depths([[0.9] * 3], [3], cost) == [0]
    # a cheap draft round still pays: 3.439/(5 + .5) = .63 > .5
    assert choose_depths([[0.9] * 3], [3], StepCost(1.0, 1.0, 0.5)) == [3]


def test_depth_per_sequence_follows_its_own_acceptance():
    # fixed 2, 2 seqs: plain 2/4; .9 -> 2.9/5; .81 -> 3.71/6; .729 -> 4.44/7 = .63;
    # the other's .1 * 7 < 4.44: it stays at 0
    cost = StepCost(fixed_s=2.0, per_row_s=1.0)
    assert choose_depths([[0.9] * 3, [0.1] * 3], [3, 3], cost) == [3, 0]


def test_caps_bound_depth_and_prefill_rows_count():
    assert choose_depths([[0.9] * 3, [0.9] * 3], [1, 0], MS) == [1, 0]
    # 100 prefill rows make the step long: a verify row is cheap next to it
    # (plain 1/102; d1 1.2/103; d2 .04 * 103 > 1.2 -> 1.24/104; d3 .008 * 104 < 1.24)
    assert choose_depths([[0.2] * 3], [3], MS, other_rows=100) == [2]
    assert choose_depths([[0.2] * 3], [3], MS) == [0]
    assert choose_depths([], [], MS) == []


def test_counts_try_positions_up_to_the_first_rejection():
    c = PositionCounts.empty(3)
    c.record(3, 1, decay=1.0)  # d1 accepted, d2 rejected, d3 not tried
    assert (c.trials, c.hits) == ([1, 1, 0], [1, 0, 0])
    c.record(2, 2, decay=1.0)  # both accepted; d3 was not verified
    assert (c.trials, c.hits) == ([2, 2, 0], [2, 1, 0])
    assert c.rates([0.5, 0.5, 0.5], weight=2.0) == pytest.approx([0.75, 0.5, 0.5])


def test_linear_fit_recovers_fixed_and_per_row_cost():
    fit = _LinearFit(decay=1.0)
    for rows in (4, 8, 16, 64):
        fit.add(rows, 1.0 + 0.5 * rows)
    a, b = fit.coefficients()
    assert (a, b) == (pytest.approx(1.0), pytest.approx(0.5))


def _learned(batch: int, accepted: int) -> AdaptiveDepth:
    """Estimates after steps of `batch` sequences at full depth accepting `accepted`;
    steps cost 1 + rows ms, the rest of a step 0."""
    policy = AdaptiveDepth(num_steps=3)
    for step in range(60):
        for seq in range(batch):
            policy.observe_round(seq, 3, accepted)
        rows = batch * 4 if step % 2 else batch  # rows vary (as prefill and depth do)
        policy.observe_step(rows, 1.0 + rows, 0.0, 0.0, asked=True)
    return policy


def test_policy_learns_cost_and_rates_then_drafts_again_when_it_pays():
    policy = _learned(batch=16, accepted=1)  # rates ~ [1, 0, ...]: d1 always, d2 never
    cost = policy.cost()
    assert (cost.fixed_s, cost.per_row_s) == (pytest.approx(1.0), pytest.approx(1.0))
    assert policy.rates(0)[0] > 0.95 and policy.rates(0)[1] < 0.1
    # 16 sequences: the sure first draft pays, the second does not
    assert policy.depths(list(range(16)), [3] * 16) == [1] * 16
    policy = _learned(batch=16, accepted=0)
    assert policy.depths(list(range(16)), [3] * 16) == [0] * 16
    # load falls to one sequence, drafting not measured there: plain stays plain (a
    # switch flushes every held row) until a probe spell drafts soon, at the caps
    for _ in range(10):
        policy.observe_round("good", 3, 3)
    chosen = [policy.depths(["good"], [3])[0] for _ in range(SPELL + GATE_MIN + 1)]
    assert chosen[:SPELL + GATE_MIN - 1] == [0] * (SPELL + GATE_MIN - 1)
    assert chosen[-1] == 3


def test_unmeasured_policy_verifies_full_depth_and_forgets_finished_sequences():
    policy = AdaptiveDepth(num_steps=3)
    assert policy.depths([0, 1], [3, 2]) == [3, 2]
    policy.observe_round(7, 3, 0)
    policy.forget(7)
    assert 7 not in policy.seqs


def _tokens_per_s(rates, depths, cost: StepCost, other_rows: int = 0) -> float:
    """The objective, spelled out: expected tokens over the step's seconds."""
    tokens = sum(expected_tokens(r, k) for r, k in zip(rates, depths, strict=True))
    seconds = cost.fixed_s + cost.per_row_s * (sum(k + 1 for k in depths) + other_rows)
    return tokens / (seconds + (cost.draft_s if any(depths) else 0.0))


def test_choice_maximises_tokens_per_second_against_brute_force():
    rng = random.Random(7)
    for _ in range(300):
        n, k = rng.randint(1, 3), rng.randint(1, 3)
        rates = [sorted((rng.random() for _ in range(k)), reverse=rng.random() < 0.5)
                 for _ in range(n)]
        caps = [rng.randint(0, k) for _ in range(n)]
        cost = StepCost(rng.uniform(0, 3), rng.uniform(0.01, 2), rng.choice([0, 0.5, 3]))
        other = rng.choice([0, 0, 20])
        best = max(_tokens_per_s(rates, d, cost, other)
                   for d in itertools.product(*(range(c + 1) for c in caps)))
        chosen = choose_depths(rates, caps, cost, other)
        assert all(0 <= d <= c for d, c in zip(chosen, caps, strict=True))
        assert _tokens_per_s(rates, chosen, cost, other) == pytest.approx(best, rel=1e-9)


def test_expensive_rows_choose_plain_and_cheap_rows_full_depth():
    rates = [[0.8] * 4] * 8
    assert choose_depths(rates, [4] * 8, StepCost(1.0, 10.0)) == [0] * 8
    assert choose_depths(rates, [4] * 8, StepCost(10.0, 0.01)) == [4] * 8


def test_margin_keeps_plain_unless_drafting_clearly_pays():
    # plain 1/2 = .5; one draft at .525: 1.525/3 = .508, 1.7 % better: not enough
    rates, cost = [[0.525, 0.0]], StepCost(1.0, 1.0)
    assert choose_depths(rates, [2], cost) == [1]
    assert choose_depths(rates, [2], cost, margin=SWITCH_MARGIN) == [0]


def _policy_with_rounds(clean_s: float, prompt_s: float, prompt_steps: int) -> AdaptiveDepth:
    """Steps of 2 rows, 2 ms each; rounds without prompt rows take `clean_s`, and
    `prompt_steps` rounds that carried prompt rows take `prompt_s`."""
    policy = AdaptiveDepth(num_steps=3)
    for step in range(40):
        prompt = step < prompt_steps
        policy.observe_step(2 + step % 2, 2.0, 0.5, prompt_s if prompt else clean_s,
                            asked=True, prompt_rows=prompt)
    return policy


def _rate(rates, depths, cost: StepCost) -> float:
    rows = sum(1 + k for k in depths)
    round_s = cost.round_s(max(depths)) if any(depths) else 0.0
    tokens = sum(expected_tokens(r, k) for r, k in zip(rates, depths, strict=True))
    return tokens / (cost.fixed_s + cost.per_row_s * rows + round_s)


@pytest.mark.parametrize("seed", range(40))
def test_a_round_priced_by_its_depth_is_chosen_as_well_as_every_choice_allows(seed):
    """Drafter-side depth: a round of D steps costs `draft_s + draft_step_s * D`. The
    choice's tokens per second equals the best of every depth vector (brute force)."""
    rng = random.Random(seed)
    k, n = 4, rng.randint(1, 3)
    rates = [[rng.uniform(0.05, 0.99) for _ in range(k)] for _ in range(n)]
    caps = [rng.randint(0, k) for _ in range(n)]
    cost = StepCost(rng.uniform(0.5, 5), rng.uniform(0.05, 1), rng.uniform(0, 2),
                    rng.uniform(0, 1.5))
    out = choose_round(rates, caps, cost)
    assert all(0 <= d <= c for d, c in zip(out, caps, strict=True))
    best = max(_rate(rates, list(v), cost)
               for v in itertools.product(*[range(c + 1) for c in caps]))
    assert _rate(rates, out, cost) == pytest.approx(best)


def test_a_costly_draft_step_asks_the_drafter_for_fewer():
    """Positions 3 and 4 are near coin flips: worth their rows, not a draft step each."""
    rates = [[0.95, 0.9, 0.5, 0.4]] * 16
    free = StepCost(10.0, 0.1, 1.0, 0.0)  # position 4 (0.17 tokens) is not worth its row
    assert choose_round(rates, [4] * 16, free) == [3] * 16 == choose_depths(rates, [4] * 16, free)
    costly = StepCost(10.0, 0.1, 1.0, 3.0)
    assert choose_round(rates, [4] * 16, costly) == [2] * 16
    policy = AdaptiveDepth(num_steps=4)
    for step in range(40):  # 3 ms a draft step, at depth 4 and at depth 2 alike
        depth = 4 if step % 2 else 2
        policy.observe_step(16 + step % 3, 10.0, 0.0, 3.0 * depth, asked=True, depth=depth)
    assert policy.cost().draft_step_s == pytest.approx(3.0)
    for _ in range(20):
        for key in range(16):
            policy.observe_round(key, 4, 2)  # 2 of 4 accepted: positions 3, 4 rarely
    out = policy.depths(list(range(16)), [4] * 16)
    assert max(out) == policy.ask < 4


def test_prompt_rows_do_not_price_drafting_out():
    # the first 20 rounds carried prompt rows (the drafter's work whatever the depth)
    policy = _policy_with_rounds(clean_s=0.3, prompt_s=50.0, prompt_steps=20)
    cost = policy.cost()
    assert cost.round_s(3) == pytest.approx(0.3)
    assert cost.fixed_s == pytest.approx(policy.forward.coefficients()[0] + 0.5)
    for _ in range(10):
        policy.observe_round(0, 3, 3)
    assert policy.depths([0], [3]) == [3]
    # with every round carrying prompt rows, those are all there is to go by
    assert _policy_with_rounds(0.3, 50.0, 40).cost().round_s(3) == pytest.approx(50.0)


def test_plain_policy_asks_for_drafts_again_after_a_while():
    policy = _policy_with_rounds(clean_s=100.0, prompt_s=0.0, prompt_steps=0)
    for _ in range(10):
        policy.observe_round(0, 3, 3)
    for _ in range(GATE_MIN):  # measured: drafting 100 ms a step, plain 2 ms
        policy.gate.add(1, True, 4, 100.0, verified=True)
        policy.gate.add(1, False, 1, 2.0)
    n = 3 * EXPLORE_AFTER + 2 * (SPELL + 1)
    chosen = [policy.depths([0], [3])[0] for _ in range(n)]
    # a spell at full depth each time; it confirmed plain, so the next comes later
    assert chosen == [0] * EXPLORE_AFTER + [3] * (SPELL + 1) + \
        [0] * 2 * EXPLORE_AFTER + [3] * (SPELL + 1)


def _served(gap_s: float) -> AdaptiveDepth:
    """16 sequences; steps of 16 or 64 rows costing 1 + rows ms, a 20 ms round, and
    `gap_s` between one step's end and the next one's start (a server's other threads)."""
    policy = AdaptiveDepth(num_steps=3)
    t = 0.0
    for step in range(60):
        for seq in range(16):
            policy.observe_round(seq, 3, 3)
        rows = 64 if step % 2 else 16
        policy.observe_step(rows, 1.0 + rows, 0.0, 20.0, asked=True, started_s=t)
        t += 1.0 + rows + 20.0 + gap_s
    return policy


def test_time_between_steps_counts_as_the_steps_cost():
    assert _served(0.0).cost().fixed_s == pytest.approx(1.0)
    assert _served(100.0).cost().fixed_s == pytest.approx(101.0)
    # 16 rows: plain 16/117 ms; drafting 3 deep adds ~3 tokens a sequence for 48 rows and
    # the round: worth it once every step costs 100 ms more anyway
    assert _served(0.0).depths(list(range(16)), [3] * 16) == [0] * 16
    assert _served(100.0).depths(list(range(16)), [3] * 16) == [3] * 16


def test_work_that_drafting_brings_is_a_cost_of_drafting():
    """Steps that asked for drafts leave 30 ms of other work, steps that did not 1 ms:
    the 29 ms go to the draft round's price, the 1 ms to every step's."""
    policy = AdaptiveDepth(num_steps=3)
    for step in range(40):
        asked = step % 4 == 0
        policy.observe_step(2 + step % 2, 2.0, 30.0 if asked else 1.0, 5.0, asked=asked)
    cost = policy.cost()
    a = policy.forward.coefficients()[0]
    assert cost.fixed_s == pytest.approx(a + 1.0)
    assert cost.round_s(3) == pytest.approx(5.0 + 29.0)
    assert cost.draft_s == pytest.approx(29.0)  # the round's own: 5 ms over 3 steps


def test_drafting_policy_drafts_nothing_once_in_a_while():
    policy = _learned(batch=1, accepted=3)
    # plain never measured at this batch size: a plain spell soon, running on while
    # plain stays unmeasured (no samples here)
    chosen = [policy.depths([0], [3])[0] for _ in range(SPELL + GATE_MIN + SPELL + 1)]
    assert chosen == [3] * (SPELL + GATE_MIN) + [0] * (SPELL + 1)
    # once drafting measured a clear lead at this batch size, far less often (steps cost
    # 1 + rows ms: plain 2 ms a token, drafting 3 deep 5.5 ms for ~4 tokens)
    for _ in range(GATE_MIN):
        policy.gate.add(1, True, 4, 5.5, verified=True)
        policy.gate.add(1, False, 1, 2.0)
    assert policy.depths([0], [3]) == [0]  # plain measured: the spell's last step
    chosen = [policy.depths([0], [3])[0] for _ in range(PROBE_PLAIN_AFTER + SPELL)]
    assert policy.lead >= 1.25
    assert chosen == [3] * PROBE_PLAIN_AFTER + [0] * SPELL


def _two_loads_measured() -> AdaptiveDepth:
    """Measured at 2 sequences, where drafting leads (4 tokens in 5.5 ms against 2 ms a
    token), and at 64, where plain does (4 tokens in 160 ms against 30 ms); the load's
    running mean at 2, as after a light point."""
    policy = _learned(batch=2, accepted=3)
    for _ in range(GATE_MIN + 1):
        policy.gate.add(2, True, 8, 5.5, verified=True)
        policy.gate.add(2, False, 2, 2.0)
        policy.gate.add(64, True, 320, 160.0, verified=True)
        policy.gate.add(64, False, 64, 30.0)
    policy.load = 2.0
    return policy


def test_demand_leads_the_load_mean_up():
    # a closed loop's next point: 64 requests arrive at once, two of them decoding so far.
    # The mean alone (at 2) drafts at the light load's verdict; the demand (running and
    # waiting) puts the step at 64's, plain, from the first step
    assert _two_loads_measured().depths([0, 1], [3, 3]) == [3, 3]
    heavy = _two_loads_measured()
    assert heavy.depths([0, 1], [3, 3], demand=64) == [0, 0]
    assert heavy.load == 64.0
    # and it falls slowly once the demand is gone (a wave's tail stays plain)
    assert heavy.depths([0, 1], [3, 3], demand=2) == [0, 0]
    assert heavy.load > 60


def test_gate_buckets_are_octaves_around_powers_of_two():
    assert bucket(63) == bucket(64) == bucket(46) == bucket(90)
    assert bucket(45) != bucket(46) and bucket(1) != bucket(2)


def test_measured_lead_counts_rounds_past_their_deadline():
    # plain 2 ms a step; drafting 4.5 ms with drafts in hand (3 tokens a sequence),
    # 11 ms without (a token)
    always = Measured(plain_s=2.0, hit_s=4.5, miss_s=11.0, hit=1.0)
    assert always.lead(3.0) == pytest.approx(3 / 4.5 * 2)
    half = Measured(plain_s=2.0, hit_s=4.5, miss_s=11.0, hit=0.5)
    # (.5 * 3 + .5 * 1) tokens in (.5 * 4.5 + .5 * 11) ms, against .5 tokens/ms
    assert half.lead(3.0) == pytest.approx(2 / 7.75 * 2)
    assert half.lead(1.0) < 1  # nothing accepted: the misses' waits are all there is


class Served:
    """The verifier's side of the policy, one sequence at a time at batch `batch`:
    depths, the verdicts, then the step's measured seconds (a drafting step `draft_ms`
    at full depth, a plain one `plain_ms`; the first rounds after plain carry no
    drafts, and the first one costs `flush_ms` more: the held rows' round)."""

    def __init__(self, batch: int, draft_ms: float, plain_ms: float, k: int = 4,
                 flush_ms: float = 0.0):
        self.policy, self.batch, self.k = AdaptiveDepth(num_steps=k), batch, k
        self.draft_ms, self.plain_ms, self.flush_ms = draft_ms, plain_ms, flush_ms
        self.t, self.asked = 0.0, (False, False)
        self.drafted: list[bool] = []

    def run(self, keys, accepted: int, steps: int) -> list[int]:
        chosen = []
        for _ in range(steps):
            depths = self.policy.depths(keys, [self.k] * len(keys))
            asked = any(depths)
            in_hand = asked and all(self.asked)
            for key, d in zip(keys, depths, strict=True):
                if in_hand and d:
                    self.policy.observe_round(key, d, min(d, accepted))
            rows = len(keys) + (sum(depths) if in_hand else 0)
            self.policy.observe_step(rows, rows * 0.1, 0.0, 0.0, asked, started_s=self.t,
                                     batch=len(keys), verified=in_hand)
            self.t += self.draft_ms if asked else self.plain_ms
            self.t += self.flush_ms if asked and not self.asked[1] else 0.0
            self.asked = (self.asked[1], asked)
            chosen.append(max(depths))
        return chosen


def test_a_hard_prompt_does_not_price_drafting_out_for_the_next_one():
    """Batch 1, drafting steps 10 ms, plain 4 ms: drafting pays at the demo's acceptance.
    A prompt whose drafts are all rejected drafts less; the prompt after it, accepting
    as the first did, drafts again at once (a gate on tokens/s kept the hard prompt's
    rounds and decoded plain: at c=1, 492 of 804 rounds)."""
    served = Served(batch=1, draft_ms=10.0, plain_ms=4.0)
    served.run(["easy"], accepted=3, steps=120)
    hard = served.run(["hard"], accepted=0, steps=40)
    after = served.run(["next"], accepted=3, steps=40)
    assert sum(d > 0 for d in hard[-10:]) <= 2
    assert sum(d > 0 for d in after) >= 40 - SPELL


def test_high_load_where_plain_is_faster_stays_plain_and_probes_rarely():
    """64 sequences: drafting steps 160 ms (4 tokens each), plain 30 ms: plain wins.
    Once measured, nearly every step is plain, and each probe that confirms it makes
    the next one rarer."""
    served = Served(batch=64, draft_ms=160.0, plain_ms=30.0)
    keys = list(range(64))
    chosen = served.run(keys, accepted=3, steps=3000)
    assert sum(d > 0 for d in chosen[1000:]) < 0.01 * 2000
    assert served.policy.backoff == MAX_BACKOFF


def _spells(chosen: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(chosen) if not a and b)


def test_a_costly_flush_makes_probes_from_plain_rare():
    """As above, but each return to drafting first pays a 3 s round (64 sequences' held
    rows): the next probe waits until plain ran 20 times that (5 %)."""
    keys = list(range(64))
    cheap = Served(batch=64, draft_ms=160.0, plain_ms=30.0)
    costly = Served(batch=64, draft_ms=160.0, plain_ms=30.0, flush_ms=3000.0)
    cheap_spells = _spells(cheap.run(keys, accepted=3, steps=3000)[300:])
    costly_spells = _spells(costly.run(keys, accepted=3, steps=3000)[300:])
    assert costly.policy.flush_s >= 3000.0
    assert costly_spells <= 1 < cheap_spells  # 3000 steps are 90 s of plain: 60 s apart


def _measure(policy: AdaptiveDepth, lead: float) -> None:
    """Fill the gate at batch 1 so that drafting 3 deep at rates ~1 (4 tokens) leads
    plain by `lead`: plain 2 ms a token (1 + 1 row), drafting 4 x 2 / lead ms."""
    for _ in range(32):
        policy.gate.add(1, True, 4, 8.0 / lead, verified=True)
        policy.gate.add(1, False, 1, 2.0)


def test_measured_choice_has_hysteresis_both_ways():
    policy = _learned(batch=1, accepted=3)
    _measure(policy, 0.95)  # a little behind plain: drafting goes on
    assert policy.depths([0], [3]) == [3]
    _measure(policy, 0.5)  # far behind: plain
    assert policy.depths([0], [3]) == [0]
    _measure(policy, 1.03)  # a little ahead of plain: plain goes on
    assert policy.depths([0], [3]) == [0]
    _measure(policy, 1.2)
    assert policy.depths([0], [3]) == [3]
    assert policy.lead == pytest.approx(1.2, rel=0.01)  # rates ~1, not quite


def test_measured_drafting_verifies_the_rounds_depth_for_every_sequence():
    """Once the gate decides, every sequence verifies the round's depth, to its cap: the
    round drafts that many for all of them, so a shallower sequence saves only its verify
    rows (at c=32 a spread that cut 11 % of the drafts saved 3 % of a step). Verify rows
    at 1 ms here, a sequence whose drafts are all rejected was spread to 0."""
    policy = _learned(batch=2, accepted=3)
    for _ in range(20):
        policy.observe_round("doubt", 3, 0)
    for _ in range(32):
        policy.gate.add(2, True, 8, 4.0, verified=True)
        policy.gate.add(2, False, 2, 2.0)
    assert choose_depths([policy.rates(0), policy.rates("doubt")], [3, 3],
                         policy.cost()) == [3, 0]
    assert policy.depths([0, "doubt"], [3, 3]) == [3, 3]
    assert policy.depths([0, "doubt"], [3, 1]) == [3, 1]


def _plain_samples_after_drafting(flush_s: float) -> int:
    """3 drafting steps, then 40 plain ones, 100 ms each: plain samples taken."""
    policy = AdaptiveDepth(num_steps=3)
    for i, asked in enumerate([True] * 3 + [False] * 40):
        if i == 3:
            policy.flush_s = flush_s  # as the last switch measured it
        policy.observe_step(1, 0.05, 0.0, 0.0, asked, started_s=0.1 * i, batch=1)
    return policy.gate.count(1, False)


def test_plain_steps_while_the_drafter_catches_up_are_no_samples():
    # the last drafting step started at 0.2 s; with a 1 s flush measured, plain steps
    # before 2.2 s share the host with the drafter's backlog: steps from 2.2 s to 4.1 s
    assert _plain_samples_after_drafting(1.0) in (19, 20, 21)
    # no flush: all but the first SETTLE (the backlog's, however short the flush) and
    # the last (its time ends with the next step)
    assert _plain_samples_after_drafting(0.0) == 40 - SETTLE - 1


def test_plain_steps_while_a_drafter_batch_is_unanswered_are_no_samples():
    """3 drafting steps, then 40 plain ones: the drafter answers the last batch only
    after the 30th (a flush of 64 sequences' held rows outlasts SETTLE many times)."""
    policy = AdaptiveDepth(num_steps=3)
    for i, asked in enumerate([True] * 3 + [False] * 40):
        policy.observe_step(1, 0.05, 0.0, 0.0, asked, started_s=0.1 * i, batch=1,
                            drafter_busy=3 <= i < 33)
    assert policy.gate.count(1, False) == 40 - 30 - 1  # the last: its time ends later


def _heavier_load_after_plain_won(forget: bool) -> list[int]:
    """32 sequences where plain is faster (drafting 160 ms a step, plain 30 ms), then 64:
    the depths chosen over the first 150 steps at 64. `forget`: the gate's verdict at
    the lighter load is dropped first."""
    served = Served(batch=32, draft_ms=160.0, plain_ms=30.0)
    served.run(list(range(32)), accepted=3, steps=1000)
    assert served.policy.behind[bucket(32)]
    served.policy.load = 64.0  # NOTE: at once, so no step at 32 measures it again
    if forget:
        served.policy.behind.clear()
    return served.run(list(range(64)), accepted=3, steps=150)


def test_a_heavier_load_than_one_where_drafting_lost_is_not_probed_at_once():
    # the lead falls with load, so a heavier bucket stays plain until the periodic probe
    # (64 steps and 20 flushes of plain later); without the lighter load's verdict the
    # unmeasured bucket is probed at once
    assert not any(_heavier_load_after_plain_won(forget=False))
    assert any(_heavier_load_after_plain_won(forget=True))


def test_idle_time_between_steps_does_not_repay_a_flush():
    """64 sequences, plain ahead, a 1 s flush measured: plain steps of 30 ms each, the
    stack idle 10 s after every tenth (a benchmark's other stacks' turns). 300 plain
    steps are 9 s of running: short of the 20 s that repay the flush, so no probe; had
    the idle waits counted, 300 s of it would have."""
    policy = _learned(batch=64, accepted=3)
    keys = list(range(64))
    for _ in range(GATE_MIN + 1):
        policy.gate.add(64, True, 320, 0.160, verified=True)
        policy.gate.add(64, False, 64, 0.030)
    policy.flush_s = 1.0
    t, chosen = 0.0, []
    for step in range(300):
        depths = policy.depths(keys, [3] * 64)
        chosen.append(max(depths))
        idle = step % 10 == 9
        policy.observe_step(64, 0.02, 0.0, 0.0, any(depths), started_s=t, batch=64,
                            idle_after=idle)
        t += 0.030 + (10.0 if idle else 0.0)
    assert policy.plain_s < 10.0
    assert not any(chosen[EXPLORE_AFTER:])


def _simulate(steps: int, accepted, step_s) -> tuple[list[int], AdaptiveDepth]:
    """64 sequences from scratch, 3 deep, at the policy's depths: `accepted(d)` drafts of d
    are accepted; `step_s(asked, before)` is the step's seconds (`before`: whether the
    two steps before it asked). -> (the deepest depth of each step, the policy)."""
    policy = AdaptiveDepth(num_steps=3)
    keys, t, before, chosen = list(range(64)), 0.0, (False, False), []
    for _ in range(steps):
        depths = policy.depths(keys, [3] * 64)
        asked = any(depths)
        in_hand = asked and all(before)
        for key, d in zip(keys, depths, strict=True):
            if in_hand and d:
                policy.observe_round(key, d, accepted(d))
        rows = 64 + (sum(depths) if in_hand else 0)
        policy.observe_step(rows, rows * 1e-4, 0.0, 0.0, asked, started_s=t, batch=64,
                            verified=in_hand)
        t += step_s(asked, before)
        before = (before[1], asked)
        chosen.append(max(depths))
    return chosen, policy


def _behind_a_backlog(steps: int) -> tuple[list[int], AdaptiveDepth]:
    """Every draft accepted. Drafting steps 160 ms (the first after plain 1 s more: the
    held rows' flush); plain steps 30 ms, but 100 ms within 1.5 s of the last drafting
    step (the drafter's backlog takes the cores). Rows are cheap to the model, and
    backlogged plain steps make drafting's extra overhead look small to it."""
    clock = {"t": 0.0, "last_asked": float("-inf")}

    def step_s(asked: bool, before: tuple[bool, bool]) -> float:
        if asked:
            took = 0.160 + (0.0 if before[1] else 1.0)
            clock["last_asked"] = clock["t"] + took
        else:
            took = 0.100 if clock["t"] - clock["last_asked"] < 1.5 else 0.030
        clock["t"] += took
        return took
    return _simulate(steps, lambda d: d, step_s)


def test_a_plain_probe_outlasts_the_drafters_backlog():
    # plain is fastest (64 tokens / 30 ms against 256 / 160 ms), but a SPELL-step plain
    # probe falls wholly in the backlog, whose steps are no samples: plain stayed
    # unmeasured, the model decided, and it drafted 11 steps in 17 for good. The spell
    # now runs on until plain is measured; then the gate keeps plain
    chosen, policy = _behind_a_backlog(600)
    assert policy.gate.count(64, False) >= GATE_MIN
    assert sum(d > 0 for d in chosen[300:]) <= SPELL + 1


def _plain_after_a_settling_backlog(steps: int) -> list[int]:
    """2 of 3 drafts accepted. Drafting steps 80 ms (~3 tokens a sequence: 2400 tokens/s);
    plain steps 20 ms (3200 tokens/s), but 60 ms for the first 8 after a drafting step,
    however short the flush (the drafter's backlog, the finished requests' prompts: at
    c=64 on an idle box 80, 73, 57, 57, 48, 34, 37, 31 ms, then 17-26). No flush:
    drafting steps cost the same right after plain."""
    since = [99]

    def step_s(asked: bool, _before: tuple[bool, bool]) -> float:
        since[0] = 0 if asked else since[0] + 1
        return 0.080 if asked else 0.060 if since[0] <= 8 else 0.020
    return _simulate(steps, lambda d: min(d, 2), step_s)[0]


def test_plain_is_measured_once_the_backlog_settled():
    # plain samples taken right after drafting (60 ms) made drafting look 2.25x ahead
    # (3 x 60 / 80), and the gate drafted where plain was fastest; held out, plain is
    # measured at 20 ms and the gate keeps plain but for the probes
    chosen = _plain_after_a_settling_backlog(600)
    assert sum(d > 0 for d in chosen[300:]) <= 3 * (SPELL + 1)  # before: 288 of 300

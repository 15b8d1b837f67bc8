"""Draft-ahead on the drafter (DESIGN 4.8, engine/lookahead.py).

Properties: each hypothesis (a accepted, bonus or correction b) is built from the
drafter's own distributions and chain states as lookahead.py says; its entry is what a
from-scratch reference, and the drafter itself after an exact update with that outcome,
drafts (all K drafts); and look-aheads never disturb exactness: the real MTP cache is
untouched, and every exact round still equals the from-scratch reference (DESIGN 3.2)."""

from __future__ import annotations

import random

import pytest
import torch

from chainspec.engine.draft_types import DraftResult, DraftSampling, SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.lookahead import AheadClock
from tests.unit.draft_reference import reference_round
from tests.unit.test_drafter_exactness import Committed, check_round, prefill
from tests.unit.tiny_models import tiny_draft_model

VOCAB = 61


def _engine(k: int, modules: int, chain: bool, graph_batch: int = 4, **ahead
            ) -> DrafterEngine:
    model = tiny_draft_model(modules, seed=modules)
    return DrafterEngine(model, DrafterConfig(num_steps=k, chain=chain, max_seqs=4,
                                              max_len=256, max_graph_batch=graph_batch,
                                              **ahead))


def _ahead(upd: SeqUpdate, verifying: tuple[int, ...] = ()) -> SeqUpdate:
    return SeqUpdate(upd.seq_id, upd.start, upd.tokens, upd.hidden, True, upd.sampling,
                     look_ahead=True, verifying=verifying)


@pytest.mark.parametrize("chain,second", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("k,modules", [(2, 2), (3, 3), (3, 1), (4, 2)])
def test_exact_rounds_equal_reference_after_look_aheads(k: int, modules: int, chain: bool,
                                                         second: bool) -> None:
    rng = random.Random(k * 7 + modules)
    torch.manual_seed(k)
    engine = _engine(k, modules, chain, graph_batch=2,  # 3 sequences: eager and buffers
                     ahead_second_round=second)
    free = engine.allocator.num_free
    seqs = {i: Committed(rng, rng.randint(1, 12)) for i in range(3)}
    updates = [_ahead(prefill(i, s)) for i, s in seqs.items()]
    entries = 0
    for _ in range(10):
        check_round(engine.model, engine.update(updates), seqs, k, chain)
        used = engine.allocator.num_free
        entries += len(engine.look_ahead())
        assert engine.allocator.num_free == used, "scratch blocks go back"
        updates = []
        for seq_id, seq in seqs.items():
            upd = seq.extend(rng, rng.randint(1, k + 1))
            verifying = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(0, k)))
            updates.append(_ahead(SeqUpdate(seq_id, upd.start, upd.tokens, upd.hidden),
                                  verifying))
    assert entries > 30 and engine.ahead_rounds == 10 * (1 + second)
    engine.release(list(seqs))
    assert engine.allocator.num_free == free


def _round_then_plan(k: int, chain: bool, verifying: tuple[int, ...], **ahead):
    rng = random.Random(11)
    engine = _engine(k, 2, chain, **ahead)
    seq = Committed(rng, 9)
    engine.update([prefill(0, seq)])
    upd = seq.extend(rng, 2)
    update = _ahead(SeqUpdate(0, upd.start, upd.tokens, upd.hidden), verifying)
    (exact,) = engine.update([update])
    entries = engine.look_ahead()
    assert [(e.seq_id, e.outcome) for e in entries] == [(0, h.outcome)
                                                         for h in engine.ahead_plan]
    return engine, seq, update, exact, engine.ahead_plan, entries


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("verifying", [(), (5, 17)])
def test_hypotheses_come_from_the_drafters_own_distributions(chain, verifying) -> None:
    k, fanout = 3, 2
    engine, seq, _, exact, hyps, _ = _round_then_plan(
        k, chain, verifying, ahead_fanout=fanout, ahead_rows=10_000, ahead_second_round=True)
    drafts, logits, states = reference_round(engine.model, seq.tokens, seq.hidden, k, chain)
    assert exact.tokens.tolist() == drafts
    verify = list(verifying) or drafts
    m = len(verify)
    _, bonus_logits, bonus_states = reference_round(
        engine.model, seq.tokens + verify, torch.cat([seq.hidden, states[:m]]), k, chain)
    assert len(hyps) == (m + 1) * fanout  # the budget takes every candidate
    for h in hyps:
        a = h.accepted
        assert list(h.outcome[:a]) == verify[:a]
        if a < m:  # a correction: one of the best alternatives to the rejected draft
            alt = logits[a].clone()
            alt[verify[a]] = -float("inf")
            assert h.outcome[-1] != verify[a]
            assert h.outcome[-1] in alt.topk(fanout).indices.tolist()
            torch.testing.assert_close(h.hidden, states[:a + 1], atol=1e-4, rtol=1e-3)
        else:  # the bonus guess after all m, from the bonus pass
            assert h.outcome[-1] in bonus_logits[0].topk(fanout).indices.tolist()
            torch.testing.assert_close(h.hidden, torch.cat([states[:m], bonus_states[:1]]),
                                       atol=1e-4, rtol=1e-3)
    probs = [h.prob for h in hyps]
    assert probs == sorted(probs, reverse=True) and [h.rank for h in hyps] == list(range(
        len(hyps)))
    assert len({h.outcome for h in hyps}) == len(hyps)


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("verifying", [(), (5, 17)])
def test_entry_equals_an_exact_update_with_its_outcome(chain, verifying) -> None:
    k = 3
    engine, seq, update, _, hyps, entries = _round_then_plan(
        k, chain, verifying, ahead_rows=10_000, ahead_second_round=True)
    base = len(seq.tokens) - 1
    for h, entry in zip(hyps, entries, strict=True):
        assert entry.base == base and entry.drafts.position == base + len(h.outcome)
        assert entry.drafts.tokens.shape == (k,), "a hit loses no draft"
        ref, _, _ = reference_round(engine.model, seq.tokens + list(h.outcome),
                                    torch.cat([seq.hidden, h.hidden]), k, chain)
        assert entry.drafts.tokens.tolist() == ref, h.outcome
        # the drafter itself, told that outcome (its hidden rows the stand-ins)
        twin = _engine(k, 2, chain)
        twin.update([prefill(0, _prefix(seq, base))])
        twin.update([SeqUpdate(0, update.start, update.tokens, update.hidden)])
        (told,) = twin.update([SeqUpdate(0, base, h.outcome, h.hidden)])
        assert told.tokens.tolist() == entry.drafts.tokens.tolist()


def _prefix(seq: Committed, base: int) -> Committed:
    """The sequence as its prefill saw it (before the last update's 2 rows)."""
    out = Committed.__new__(Committed)
    out.tokens, out.hidden = seq.tokens[:base - 1], seq.hidden[:base - 2]
    return out


def test_look_ahead_leaves_the_real_cache_and_later_drafts_untouched() -> None:
    k, rng = 3, random.Random(4)
    on = _engine(k, 2, True, graph_batch=2, ahead_second_round=True)  # NOTE: no clock
    off = _engine(k, 2, True, graph_batch=2)
    seqs = {i: Committed(rng, 4 + i) for i in range(3)}
    ups = [prefill(i, s) for i, s in seqs.items()]
    for _ in range(6):
        got, want = on.update([_ahead(u) for u in ups]), off.update(ups)
        assert [o.tokens.tolist() for o in got] == [o.tokens.tolist() for o in want]
        held = {i: list(st.blocks.blocks) for i, st in on.seqs.items()}
        before = [t[b].clone() for t in on.cache.keys + on.cache.values
                  for bs in held.values() for b in bs]
        assert on.look_ahead(), "every round has hypotheses"
        after = [t[b] for t in on.cache.keys + on.cache.values
                 for bs in held.values() for b in bs]
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        assert {i: list(st.blocks.blocks) for i, st in on.seqs.items()} == held
        ups = []
        for i, seq in seqs.items():  # random verdicts: the look-aheads miss
            u = seq.extend(rng, rng.randint(1, k + 1))
            ups.append(SeqUpdate(i, u.start, u.tokens, u.hidden))


@pytest.mark.parametrize("chain", [True, False])
def test_one_round_look_ahead_drafts_the_bonus_guess_in_its_bonus_pass(chain) -> None:
    """Without a second round, (m, b) comes from the bonus pass itself: b its step 1,
    its K-1 drafts steps 2..K; the corrections keep their full K drafts."""
    k = 3
    engine, seq, _, exact, hyps, entries = _round_then_plan(
        k, chain, (), ahead_rows=10_000, ahead_second_round=False)
    drafts, _, states = reference_round(engine.model, seq.tokens, seq.hidden, k, chain)
    ahead, _, _ = reference_round(engine.model, seq.tokens + drafts,
                                  torch.cat([seq.hidden, states]), k, chain)
    short = [e for e in entries if e.drafts.tokens.shape[0] == k - 1]
    assert [(e.outcome, e.drafts.tokens.tolist()) for e in short] == \
        [((*drafts, ahead[0]), ahead[1:])]
    assert all(len(e.outcome) <= k for e in entries if e not in short)
    assert len(entries) == 1 + k * engine.config.ahead_fanout


def test_budget_bounds_rows_and_keeps_the_likeliest(monkeypatch) -> None:
    k, hist = 3, 2  # history rows of each window (the prefix is long enough)
    _, _, _, _, every, _ = _round_then_plan(k, True, (), ahead_fanout=3, ahead_rows=10_000,
                                            ahead_second_round=True)
    budget = (hist + k) + 2 * (hist + 2)  # the bonus pass and two short corrections
    rounds, run = [], DrafterEngine._run_scratch

    def counted(self, windows, seq_ids, exact=()):
        rounds.append(sum(w.num_rows for w in windows))
        return run(self, windows, seq_ids, exact)
    monkeypatch.setattr(DrafterEngine, "_run_scratch", counted)
    _, _, _, _, few, _ = _round_then_plan(k, True, (), ahead_fanout=3, ahead_rows=budget,
                                          ahead_second_round=True)

    def rows(hs):
        return sum(hist + len(h.outcome) for h in hs)
    assert len(rounds) == 2 and all(r <= budget for r in rounds) and budget < rows(every)
    assert {h.outcome for h in few} < {h.outcome for h in every}
    assert few[0].outcome == every[0].outcome, "the likeliest verdict always fits"
    assert [h.rank for h in few] == list(range(len(few)))
    assert [h.prob for h in few] == sorted((h.prob for h in few), reverse=True)


def test_sampled_entry_carries_the_q_its_drafts_were_drawn_from() -> None:
    k, temp = 3, 0.8
    rng = random.Random(2)
    engine = _engine(k, 2, True, ahead_rows=10_000, ahead_second_round=True)
    top_k = engine.config.top_k  # the support size the drafter reports
    seq = Committed(rng, 9)
    sampling = DraftSampling(temp, top_k, seed=7)
    engine.update([SeqUpdate(0, 0, tuple(seq.tokens[1:]), seq.hidden, True, sampling)])
    upd = seq.extend(rng, 2)
    engine.update([SeqUpdate(0, upd.start, upd.tokens, upd.hidden, True, sampling,
                             look_ahead=True)])
    entries = engine.look_ahead()
    hyps = engine.ahead_plan
    # NOTE: the bonus pass's own (sampled) guess may be no top-F one: it keeps K-1 drafts
    full = [(h, e) for h, e in zip(hyps, entries, strict=True) if e.drafts.tokens.shape == (k,)]
    assert len(full) >= len(entries) - 1 > 0
    for h, entry in full:
        _, logits, _ = reference_round(engine.model, seq.tokens + list(h.outcome),
                                       torch.cat([seq.hidden, h.hidden]), k, True,
                                       forced=entry.drafts.tokens.tolist())
        for i in range(k):  # draft i of the entry is step i + 1's sample
            top, support = (logits[i] / temp).topk(top_k)
            assert entry.drafts.support[i].tolist() == support.tolist()
            torch.testing.assert_close(entry.drafts.probs[i], top.softmax(-1), atol=1e-5,
                                       rtol=1e-4)
            assert entry.drafts.tokens[i] in support


def test_no_look_ahead_unless_asked_or_for_k1() -> None:
    rng = random.Random(3)
    engine = _engine(2, 1, True)
    seq = Committed(rng, 5)
    engine.update([prefill(0, seq)])
    assert engine.look_ahead() == []
    k1 = _engine(1, 1, True)
    k1.update([_ahead(prefill(0, seq))])
    assert k1.look_ahead() == []


def test_released_sequence_gets_no_entry_and_bad_verifying_fails_alone() -> None:
    rng = random.Random(5)
    engine = _engine(2, 1, True)
    a, b = Committed(rng, 5), Committed(rng, 6)
    engine.update([_ahead(prefill(0, a)), _ahead(prefill(1, b))])
    engine.release([0])
    assert {e.seq_id for e in engine.look_ahead()} == {1}
    upd = b.extend(rng, 1)
    bad = SeqUpdate(1, upd.start, upd.tokens, upd.hidden, look_ahead=True,
                    verifying=(1, 2, 3))  # K = 2
    (failure,) = engine.update([bad])
    assert failure.code == "INVALID_ARGUMENT" and "verifying" in failure.message
    assert isinstance(engine.update([_ahead(SeqUpdate(1, upd.start, upd.tokens,
                                                       upd.hidden))])[0], DraftResult)


def test_clock_fits_rows_before_the_next_update_of_the_same_kind() -> None:
    """The bound runs from the answer to the shortest recent interval between an answer
    and the next update, among steps of the same kind: after a miss the verifier waits
    for the answer, then verifies (long); after a hit it waited for nothing (short)."""
    clock = AheadClock(share=0.5)
    assert clock.rows_left(0.0) is None, "nothing measured: no bound yet"
    clock.exact_done(0.002)  # a round's fixed cost: 2 ms
    clock.round_done(rows=10, seconds=0.003)  # and 0.1 ms a row beyond it
    t = 0.0
    for gap, hit in ((0.010, False), (0.020, False), (0.004, True), (0.012, False)):
        clock.update_started(t)
        clock.answered(t + 0.002, hit)  # the exact round: 2 ms
        t += 0.002 + gap  # the next update, `gap` after the answer
    clock.update_started(t)
    clock.answered(t + 0.002, hit=False)
    now = t + 0.002
    assert clock.rows_left(now - 0.00005) == 30  # (10 ms / 2 - 2 ms) / 0.1 ms: 30.5
    assert clock.rows_left(now + 0.00195) == 10  # 10.5 rows
    assert clock.rows_left(now + 0.0035) == 0, "not even a round's fixed cost fits"
    clock.update_started(now + 0.004)
    clock.answered(now + 0.006, hit=True)  # a hit's interval was 4 ms: 0 ms left
    assert clock.rows_left(now + 0.006) == 0
    clock.round_done(rows=10, seconds=0.100)  # one round descheduled: 10 ms a row
    clock.round_done(rows=10, seconds=0.003)
    assert clock.row_s == pytest.approx(0.0001), "the median: one outlier moves nothing"


def test_a_look_ahead_short_of_time_drafts_less_or_nothing() -> None:
    k = 3
    engine, _, _, _, _, _ = _round_then_plan(k, True, (), ahead_rows=10_000)
    rng = random.Random(8)
    seq = Committed(rng, 9)
    engine.ahead_clock.rows_left = lambda now: 0  # the step is over
    engine.update([_ahead(prefill(1, seq))])
    assert engine.look_ahead() == [] and engine.ahead_plan == []
    upd = seq.extend(rng, 2)
    engine.ahead_clock.rows_left = lambda now: (k - 1) + k  # the bonus pass's rows
    engine.update([_ahead(SeqUpdate(1, upd.start, upd.tokens, upd.hidden))])
    entries = engine.look_ahead()
    plan = engine.ahead_plan
    # a = m: the bonus pass's own K-1 drafts (a full-K window has K-1 + K + 1 rows); a
    # second round only for corrections short enough
    assert [(e.seq_id, e.drafts.tokens.shape[0]) for e, h in zip(entries, plan, strict=True)
            if h.accepted == k] == [(1, k - 1)]
    assert all((k - 1) + len(h.outcome) <= (k - 1) + k for h in plan if h.accepted < k)
    engine.ahead_clock.rows_left = lambda now: 10_000
    upd = seq.extend(rng, 2)
    engine.update([_ahead(SeqUpdate(1, upd.start, upd.tokens, upd.hidden))])
    entries = engine.look_ahead()
    assert len(entries) == (k + 1) * engine.config.ahead_fanout
    assert all(e.drafts.tokens.shape[0] == k for e in entries)


def _real_kv(engine: DrafterEngine, seq_id: int) -> list[torch.Tensor]:
    """The sequence's MTP KV by position (through its block table), every layer."""
    st, bs = engine.seqs[seq_id], engine.allocator.block_size
    pos = torch.arange(st.next_start)
    blocks = torch.tensor(st.blocks.blocks)[pos // bs]
    return [t[blocks, pos % bs] for t in engine.cache.keys + engine.cache.values]


@pytest.mark.parametrize("chain", [True, False])
def test_early_look_ahead_on_a_hit_rides_in_its_exact_round(chain) -> None:
    """On an update that verifies one of its entries' drafts, the look-ahead's first
    round runs in the update's own round (one batch: exact windows, then look-ahead
    windows): from the chain states that entry's round left, with the update's true rows
    after the history. The exact drafts and the real MTP cache are those of the update
    alone, and the update asks for no look-ahead of its own."""
    k, rng = 3, random.Random(21)
    engine = _engine(k, 2, chain, ahead_rows=10_000, ahead_second_round=True)
    twin = _engine(k, 2, chain)
    seq = Committed(rng, 9)
    for e in (engine, twin):
        e.update([_ahead(prefill(0, seq))])
    entries = engine.look_ahead()
    hit = next(e for e in entries if e.drafts.tokens.shape == (k,))
    src = engine._chained[(0, hit.drafts.position, tuple(hit.drafts.tokens.tolist()))]
    rows = torch.randn(len(hit.outcome), seq.hidden.shape[1])  # the target's true h
    start = len(seq.tokens) - 1
    seq.tokens += list(hit.outcome)
    seq.hidden = torch.cat([seq.hidden, rows])
    upd = _ahead(SeqUpdate(0, start, hit.outcome, rows), tuple(hit.drafts.tokens.tolist()))
    batches, run = [], engine._run
    engine._run = lambda windows, depth=None: batches.append(len(windows)) or run(windows, depth)
    (got,), (want,) = engine.update([upd]), twin.update([SeqUpdate(0, start, hit.outcome,
                                                                   rows)])
    assert len(batches) == 1 and batches[0] > 1, "one round: exact and look-ahead windows"
    assert got.tokens.tolist() == want.tokens.tolist()
    # NOTE: a batch of another shape rounds differently, within float tolerance
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(
        _real_kv(engine, 0), _real_kv(twin, 0), strict=True))
    assert engine.pending_ahead() == [], "its look-ahead already ran"
    early = engine.look_ahead_early(engine.pending_early())
    assert len(batches) == 2, "the second round (full-K drafts of a = m) is one more"
    assert early and {e.base for e in early} == {start + len(hit.outcome)}
    assert engine.pending_early() is None
    # the bonus pass of the early look-ahead: true rows, then the entry's chain states
    verify = hit.drafts.tokens.tolist()
    bonus, _, _ = reference_round(engine.model, seq.tokens + verify,
                                  torch.cat([seq.hidden, src.chain]), k, chain)
    full = next(e for e, h in zip(early, engine.ahead_plan, strict=True)
                if h.accepted == k and e.outcome[-1] == bonus[0])
    assert full.drafts.tokens.shape == (k,)
    # its full-K drafts: an exact update with that outcome (stand-in rows) drafts them
    h = next(h for h in engine.ahead_plan if h.outcome == full.outcome)
    (ref,) = twin.update([SeqUpdate(0, start + len(hit.outcome), full.outcome, h.hidden)])
    assert ref.tokens.tolist() == full.drafts.tokens.tolist()


def _a_hit_beside_a_miss(k: int):
    """Two sequences prefilled on a look-ahead engine and its twin (no look-ahead); then
    sequence 0's update hits a full-K entry of the look-ahead and sequence 1's is no hit.
    -> (engine, twin, the hit entry's key, the two updates)."""
    rng = random.Random(5)
    engine = _engine(k, 2, True, ahead_rows=10_000, ahead_second_round=True)
    twin = _engine(k, 2, True)
    seqs = {i: Committed(rng, 9 + i) for i in range(2)}
    for e in (engine, twin):
        e.update([_ahead(prefill(i, s)) for i, s in seqs.items()])
    hit = next(e for e in engine.look_ahead()
               if e.seq_id == 0 and e.drafts.tokens.shape == (k,))
    key = (0, hit.drafts.position, tuple(hit.drafts.tokens.tolist()))
    rows = torch.randn(len(hit.outcome), seqs[0].hidden.shape[1])
    miss = seqs[1].extend(rng, 2)
    updates = [_ahead(SeqUpdate(0, len(seqs[0].tokens) - 1, hit.outcome, rows), key[2]),
               _ahead(SeqUpdate(1, miss.start, miss.tokens, miss.hidden))]
    return engine, twin, key, updates


def test_a_hit_beside_a_miss_answers_first_and_looks_ahead_from_its_entry() -> None:
    """When another update of the batch is no hit, the verifier waits for the answer: the
    round drafts the exact windows alone, and the hit's look-ahead follows the answer
    with the miss's, from the chain states of the entry the hit verifies."""
    k = 3
    engine, twin, key, updates = _a_hit_beside_a_miss(k)
    chain = engine._chained[key].chain
    batches, run = [], engine._run
    engine._run = lambda windows, depth=None: batches.append(len(windows)) or run(windows, depth)
    got = engine.update(updates)
    want = twin.update([SeqUpdate(u.seq_id, u.start, u.tokens, u.hidden) for u in updates])
    assert batches == [2], "the exact windows alone"
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
    assert engine.pending_early() is None
    pending = {src.seq_id: src for src in engine.pending_ahead()}
    assert set(pending) == {0, 1} and torch.equal(pending[0].chain, chain)
    assert pending[0].verify.tolist() == list(key[2])
    assert {e.seq_id for e in engine.look_ahead(list(pending.values()))} == {0, 1}


@pytest.mark.parametrize("chain", [True, False])
def test_a_bonus_pass_entry_hit_looks_ahead_in_its_exact_round(chain) -> None:
    """A bonus pass's entry (its bonus guess, then K-1 drafts) keeps its chain states like
    a full-K entry: on its hit the look-ahead's first round rides in the exact round,
    its stand-ins g[2..K] at the bonus pass's last row, its corrections from steps
    2..K there (the drafter's distributions for x[N'+1..])."""
    k, rng = 3, random.Random(4)
    engine = _engine(k, 2, chain, ahead_rows=10_000, ahead_second_round=False)
    seq = Committed(rng, 9)
    engine.update([_ahead(prefill(0, seq))])
    hit = next(e for e in engine.look_ahead() if e.drafts.tokens.shape == (k - 1,))
    key = (0, hit.drafts.position, tuple(hit.drafts.tokens.tolist()))
    src = engine._chained[key]
    assert src.step0 == 1 and src.chain.shape[0] == k - 1
    rows = torch.randn(len(hit.outcome), seq.hidden.shape[1])
    start = len(seq.tokens) - 1
    seq.tokens += list(hit.outcome)
    seq.hidden = torch.cat([seq.hidden, rows])
    batches, run = [], engine._run
    engine._run = lambda windows, depth=None: batches.append(len(windows)) or run(windows, depth)
    engine.update([_ahead(SeqUpdate(0, start, hit.outcome, rows), key[2])])
    assert len(batches) == 1 and batches[0] > 1, "one round: exact and look-ahead windows"
    early = engine.look_ahead_early(engine.pending_early())
    bonus, _, _ = reference_round(engine.model, seq.tokens + list(key[2]),
                                  torch.cat([seq.hidden, src.chain]), k, chain)
    plan = engine.ahead_plan
    assert any(h.accepted == k - 1 and e.outcome[-1] == bonus[0]
               for e, h in zip(early, plan, strict=True))
    for a in range(k - 1):  # corrections at a: the top alternatives of step a + 2
        q = engine.model.logits(a + 2, src.chain[a:a + 1])[0].float().softmax(-1)
        q[key[2][a]] = 0.0
        want = set(q.topk(engine.config.ahead_fanout).indices.tolist())
        got = {h.outcome[-1] for h in plan if h.accepted == a}
        assert got <= want and got


def test_a_mixed_batch_splits_the_hits_after_the_answer_it_waits_for() -> None:
    """`split_hits` answers the misses first (a round over them alone); the hits' exact
    windows then ride with every look-ahead's first round in one more round: the
    misses' from committed state, the hits' from their entries' chains. Exact drafts are
    those of the updates alone, and the step clock sees one update, not two."""
    engine, twin, _, updates = _a_hit_beside_a_miss(3)
    assert engine.split_hits(updates) == ([1], [0])
    assert engine.split_hits(updates[:1]) == ([0], []), "all hits: one answer"
    batches, run = [], engine._run
    engine._run = lambda windows, depth=None: batches.append(len(windows)) or run(windows, depth)
    (got_miss,) = engine.update([updates[1]])
    pending = engine.pending_ahead()
    clock = engine.ahead_clock
    seen = ([list(g) for g in clock.gaps.values()], clock._answered, clock._hit)
    (got_hit,) = engine.update([updates[0]], rest_of=pending)
    assert ([list(g) for g in clock.gaps.values()], clock._answered, clock._hit) == seen
    want = twin.update([SeqUpdate(u.seq_id, u.start, u.tokens, u.hidden) for u in updates])
    assert batches[0] == 1 and len(batches) == 2 and batches[1] >= 1 + 2, \
        "the miss alone; then the hit, both bonus passes (and corrections)"
    assert [got_hit.tokens.tolist(), got_miss.tokens.tolist()] == \
        [w.tokens.tolist() for w in want]
    assert engine.pending_ahead() == []
    early = engine.look_ahead_early(engine.pending_early())
    assert {(e.seq_id, e.base) for e in early} == {(u.seq_id, u.start + len(u.tokens))
                                                   for u in updates}

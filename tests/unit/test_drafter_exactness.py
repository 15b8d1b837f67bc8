"""DESIGN 3.2: the incremental drafter's drafts equal a from-scratch reference over the
whole committed prefix, every round, whatever the accept lengths."""

from __future__ import annotations

import random

import pytest
import torch

from chainspec.engine.draft_types import ErrorCode, SeqFailure, SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from tests.unit.draft_reference import reference_drafts
from tests.unit.tiny_models import tiny_draft_model

VOCAB, HIDDEN = 61, 32


class Committed:
    """One sequence's committed tokens x[0..N'] and target hidden states h[0..N'-1]."""

    def __init__(self, rng: random.Random, prompt_len: int) -> None:
        self.tokens = [rng.randrange(VOCAB) for _ in range(prompt_len + 1)]
        self.hidden = torch.randn(prompt_len, HIDDEN)

    def extend(self, rng: random.Random, n: int) -> SeqUpdate:
        """Commit n more tokens (j accepted + bonus) and return the update that says so."""
        start = len(self.tokens) - 1
        new = [rng.randrange(VOCAB) for _ in range(n)]
        rows = torch.randn(n, HIDDEN)
        self.tokens += new
        self.hidden = torch.cat([self.hidden, rows])
        return SeqUpdate(0, start, tuple(new), rows)


def prefill(seq_id: int, seq: Committed) -> SeqUpdate:
    return SeqUpdate(seq_id, 0, tuple(seq.tokens[1:]), seq.hidden)


def check_round(model, outcomes, seqs, k: int, chain: bool) -> None:
    for seq_id, out in zip(seqs, outcomes, strict=True):
        seq = seqs[seq_id]
        expected, logits = reference_drafts(model, seq.tokens, seq.hidden, k, chain)
        assert out.tokens.tolist() == expected, f"seq {seq_id}"


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("k,modules", [(1, 1), (2, 2), (3, 3), (3, 1), (4, 2)])
def test_incremental_drafts_equal_reference(k: int, modules: int, chain: bool) -> None:
    rng = random.Random(k * 10 + modules)
    torch.manual_seed(k)
    model = tiny_draft_model(modules, seed=modules)
    engine = DrafterEngine(model, DrafterConfig(num_steps=k, chain=chain, max_seqs=4,
                                                max_len=256, max_graph_batch=4))
    seqs = {i: Committed(rng, rng.randint(1, 12)) for i in range(3)}
    updates = [prefill(i, s) for i, s in seqs.items()]
    for _ in range(10):
        check_round(model, engine.update(updates), seqs, k, chain)
        updates = []
        for seq_id, seq in seqs.items():
            upd = seq.extend(rng, rng.randint(1, k + 1))  # j in 0..K accepted, plus bonus
            updates.append(SeqUpdate(seq_id, upd.start, upd.tokens, upd.hidden))
    assert engine.runner.eager_runs > 0


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("k,modules,lag_rows", [(3, 3, 6), (4, 2, 8), (4, 4, 64)])
def test_rounds_of_mixed_depth_equal_reference(k: int, modules: int, lag_rows: int,
                                               chain: bool) -> None:
    """Drafter-side depth (DESIGN 4.11): rounds of 1..K draft steps, chosen at random per
    sequence, leave steps behind; every round's drafts still equal the from-scratch
    reference's first D, D the deepest ask of the round (or K once a lag passes
    `lag_rows`). A step that lagged and then ran must have caught up on the rows it
    missed, or its drafts differ."""
    rng = random.Random(k * 100 + lag_rows)
    model = tiny_draft_model(modules, seed=modules + 1)
    engine = DrafterEngine(model, DrafterConfig(num_steps=k, chain=chain, max_seqs=4,
                                                max_len=512, max_graph_batch=4,
                                                lag_rows=lag_rows))
    seqs = {i: Committed(rng, rng.randint(1, 12)) for i in range(3)}
    updates = [prefill(i, s) for i, s in seqs.items()]
    depths = []
    for r in range(40):
        outcomes = engine.update(updates)
        depth = len(outcomes[0].tokens)
        depths.append(depth)
        for seq_id, out in zip(seqs, outcomes, strict=True):
            seq = seqs[seq_id]
            expected, _ = reference_drafts(model, seq.tokens, seq.hidden, k, chain)
            assert out.tokens.tolist() == expected[:depth], f"round {r}, seq {seq_id}"
        asks = [1 if r % 10 < 7 else rng.randint(1, k) for _ in seqs]  # mostly shallow
        updates = []
        for (seq_id, seq), ask in zip(seqs.items(), asks, strict=True):
            upd = seq.extend(rng, rng.randint(1, depth + 1))
            updates.append(SeqUpdate(seq_id, upd.start, upd.tokens, upd.hidden,
                                     num_drafts=ask))
    assert depths[0] == k  # the prompts: every step writes its KV
    assert 1 in depths and depths.count(k) > 1  # shallow rounds, and catch-ups
    assert max(s.hist_hidden.shape[0] for s in engine.seqs.values()) <= lag_rows


def test_a_round_runs_the_deepest_ask_and_a_lag_past_its_bound_asks_for_all() -> None:
    k = 4
    engine = DrafterEngine(tiny_draft_model(2, seed=3),
                           DrafterConfig(num_steps=k, max_seqs=2, max_len=256, lag_rows=8))
    rng = random.Random(3)
    a, b = Committed(rng, 5), Committed(rng, 5)
    engine.update([prefill(0, a), prefill(1, b)])
    ua, ub = a.extend(rng, 2), b.extend(rng, 2)
    out = engine.update([SeqUpdate(0, ua.start, ua.tokens, ua.hidden, num_drafts=1),
                         SeqUpdate(1, ub.start, ub.tokens, ub.hidden, num_drafts=2)])
    assert [len(o.tokens) for o in out] == [2, 2]
    # steps 3 and 4 lag by these two rows: the history holds K-1 + 2 of them
    assert engine.seqs[0].valid[2:] == [5 - 3, 5 - 4]
    assert engine.seqs[0].hist_hidden.shape[0] == k - 1 + 2
    depths = []
    for _ in range(4):  # 2 rows a round: the full-depth window passes 8 rows in round 2
        ua = a.extend(rng, 2)
        out = engine.update([SeqUpdate(0, ua.start, ua.tokens, ua.hidden, num_drafts=1)])
        depths.append(len(out[0].tokens))
    assert depths == [1, k, 1, 1]
    assert engine.seqs[0].hist_hidden.shape[0] == k - 1 + 4


@pytest.mark.parametrize("chain", [True, False])
def test_resync_and_chunked_prefill_match_reference(chain: bool) -> None:
    rng = random.Random(7)
    model = tiny_draft_model(3, seed=3)
    k = 3
    engine = DrafterEngine(model, DrafterConfig(num_steps=k, chain=chain, max_seqs=2,
                                                max_len=256, max_graph_batch=2))
    seq = Committed(rng, 19)
    for c0 in range(0, 19, 4):  # chunked prefill: only the last chunk wants drafts
        n = min(4, 19 - c0)
        out = engine.update([SeqUpdate(5, c0, tuple(seq.tokens[c0 + 1:c0 + 1 + n]),
                                       seq.hidden[c0:c0 + n], want_drafts=c0 + n == 19)])
    check_round(model, out, {5: seq}, k, chain)
    for _ in range(3):
        upd = seq.extend(rng, rng.randint(1, k + 1))
        out = engine.update([SeqUpdate(5, upd.start, upd.tokens, upd.hidden)])
        check_round(model, out, {5: seq}, k, chain)
    # Resync: the verifier rebuilds the state from scratch with start = 0.
    seq.extend(rng, 2)  # two rounds the drafter never saw
    check_round(model, engine.update([prefill(5, seq)]), {5: seq}, k, chain)
    upd = seq.extend(rng, 1)
    check_round(model, engine.update([SeqUpdate(5, upd.start, upd.tokens, upd.hidden)]),
                {5: seq}, k, chain)


def test_out_of_sync_start_fails_alone() -> None:
    rng = random.Random(1)
    model = tiny_draft_model(2)
    engine = DrafterEngine(model, DrafterConfig(num_steps=2, max_seqs=4, max_len=128))
    a, b = Committed(rng, 5), Committed(rng, 6)
    engine.update([prefill(1, a), prefill(2, b)])
    upd_a = a.extend(rng, 2)
    upd_b = b.extend(rng, 1)
    outcomes = engine.update([SeqUpdate(1, upd_a.start + 1, upd_a.tokens, upd_a.hidden),
                              SeqUpdate(2, upd_b.start, upd_b.tokens, upd_b.hidden),
                              SeqUpdate(9, 3, (1,), torch.randn(1, HIDDEN))])
    bad, good, unknown = outcomes
    assert isinstance(bad, SeqFailure) and bad.code == ErrorCode.FAILED_PRECONDITION
    assert bad.expected_start == upd_a.start
    assert isinstance(unknown, SeqFailure) and unknown.code == ErrorCode.FAILED_PRECONDITION
    expected, _ = reference_drafts(model, b.tokens, b.hidden, 2, True)
    assert good.tokens.tolist() == expected
    # The failed sequence is still at its old state: the right start continues it.
    fixed = engine.update([SeqUpdate(1, upd_a.start, upd_a.tokens, upd_a.hidden)])[0]
    assert fixed.tokens.tolist() == reference_drafts(model, a.tokens, a.hidden, 2, True)[0]


@pytest.mark.parametrize("update,code", [
    (SeqUpdate(1, 0, (1,), torch.zeros(1, HIDDEN + 1)), "INVALID_ARGUMENT"),
    (SeqUpdate(1, 0, (VOCAB,), torch.zeros(1, HIDDEN)), "INVALID_ARGUMENT"),
    (SeqUpdate(1, 0, (1,), torch.full((1, HIDDEN), float("nan"))), "INVALID_ARGUMENT"),
    (SeqUpdate(1, 0, (1,) * 200, torch.zeros(200, HIDDEN)), "RESOURCE_EXHAUSTED"),
])
def test_bad_updates_get_a_code_and_spare_the_rest(update: SeqUpdate, code: str) -> None:
    model = tiny_draft_model(2)
    engine = DrafterEngine(model, DrafterConfig(num_steps=2, max_seqs=2, max_len=128))
    rng = random.Random(0)
    good = Committed(rng, 4)
    bad_out, good_out = engine.update([update, prefill(2, good)])
    assert isinstance(bad_out, SeqFailure) and bad_out.code == code
    assert good_out.tokens.tolist() == reference_drafts(model, good.tokens, good.hidden, 2,
                                                        True)[0]
    assert engine.load == 1


def test_malformed_updates_cannot_be_built() -> None:
    for tokens, rows in (((), 0), ((1, 2), 3)):
        with pytest.raises(ValueError, match="hidden"):
            SeqUpdate(1, 0, tokens, torch.zeros(rows, HIDDEN))


def test_capacity_and_release() -> None:
    model = tiny_draft_model(1)
    engine = DrafterEngine(model, DrafterConfig(num_steps=1, max_seqs=2, max_len=64))
    rng = random.Random(0)
    seqs = [Committed(rng, 3) for _ in range(3)]
    outs = engine.update([prefill(i, s) for i, s in enumerate(seqs)])
    assert [isinstance(o, SeqFailure) for o in outs] == [False, False, True]
    assert outs[2].code == "RESOURCE_EXHAUSTED"
    engine.release([0])
    assert engine.load == 1
    assert not isinstance(engine.update([prefill(2, seqs[2])])[0], SeqFailure)

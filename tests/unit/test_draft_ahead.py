"""Draft-ahead on the drafter (DESIGN 4.8, engine/lookahead.py).

Two properties: a look-ahead entry is what a from-scratch reference drafts for its
hypothesis (the verified drafts all accepted, the drafter's chain states standing in for
the target hidden states), and look-aheads never disturb exactness: after any mix of
them, every exact round still equals the from-scratch reference over the committed
prefix (DESIGN 3.2)."""

from __future__ import annotations

import random

import pytest
import torch

from chainspec.engine.draft_types import DraftResult, DraftSampling, SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from tests.unit.draft_reference import reference_round
from tests.unit.test_drafter_exactness import Committed, check_round, prefill
from tests.unit.tiny_models import tiny_draft_model

VOCAB = 61


def _engine(k: int, modules: int, chain: bool, graph_batch: int = 4) -> DrafterEngine:
    model = tiny_draft_model(modules, seed=modules)
    return DrafterEngine(model, DrafterConfig(num_steps=k, chain=chain, max_seqs=4,
                                              max_len=256, max_graph_batch=graph_batch))


def _ahead(upd: SeqUpdate, verifying: tuple[int, ...] = ()) -> SeqUpdate:
    return SeqUpdate(upd.seq_id, upd.start, upd.tokens, upd.hidden, True, upd.sampling,
                     look_ahead=True, verifying=verifying)


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("k,modules", [(2, 2), (3, 3), (3, 1), (4, 2)])
def test_exact_rounds_equal_reference_after_look_aheads(k: int, modules: int,
                                                         chain: bool) -> None:
    rng = random.Random(k * 7 + modules)
    torch.manual_seed(k)
    engine = _engine(k, modules, chain, graph_batch=2)  # 3 sequences: eager and buffers
    seqs = {i: Committed(rng, rng.randint(1, 12)) for i in range(3)}
    updates = [_ahead(prefill(i, s)) for i, s in seqs.items()]
    entries = 0
    for _ in range(10):
        check_round(engine.model, engine.update(updates), seqs, k, chain)
        entries += len(engine.look_ahead())
        updates = []
        for seq_id, seq in seqs.items():
            upd = seq.extend(rng, rng.randint(1, k + 1))
            verifying = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(0, k)))
            updates.append(_ahead(SeqUpdate(seq_id, upd.start, upd.tokens, upd.hidden),
                                  verifying))
    assert entries == 30 and engine.ahead_rounds == 10


@pytest.mark.parametrize("chain", [True, False])
@pytest.mark.parametrize("verify_own", [True, False])
def test_entry_equals_reference_for_its_hypothesis(chain: bool, verify_own: bool) -> None:
    k = 3
    rng = random.Random(11)
    engine = _engine(k, 2, chain)
    seq = Committed(rng, 9)
    out = engine.update([prefill(0, seq)])
    upd = seq.extend(rng, 2)
    verifying = () if verify_own else (5, 17)
    (exact,) = engine.update([_ahead(SeqUpdate(0, upd.start, upd.tokens, upd.hidden),
                                     verifying)])
    (entry,) = engine.look_ahead()
    drafts, _, states = reference_round(engine.model, seq.tokens, seq.hidden, k, chain)
    assert isinstance(out[0], DraftResult) and exact.tokens.tolist() == drafts
    verify = list(verifying) if verifying else drafts
    m = len(verify)
    base = len(seq.tokens) - 1
    # the hypothesis: x[N'+1..N'+m] = verify, h[N'+i] stood in for by g[i+1] at row N'-1
    ahead, _, _ = reference_round(engine.model, seq.tokens + verify,
                                  torch.cat([seq.hidden, states[:m]]), k, chain)
    assert entry.base == base and entry.outcome == (*verify, ahead[0])
    assert entry.drafts.position == base + m + 1
    assert entry.drafts.tokens.tolist() == ahead[1:]


def test_sampled_entry_carries_the_q_its_drafts_were_drawn_from() -> None:
    k, temp = 3, 0.8
    rng = random.Random(2)
    engine = _engine(k, 2, True)
    top_k = engine.config.top_k  # the support size the drafter reports
    seq = Committed(rng, 9)
    sampling = DraftSampling(temp, top_k, seed=7)
    engine.update([SeqUpdate(0, 0, tuple(seq.tokens[1:]), seq.hidden, True, sampling)])
    upd = seq.extend(rng, 2)
    (exact,) = engine.update([SeqUpdate(0, upd.start, upd.tokens, upd.hidden, True,
                                        sampling, look_ahead=True)])
    (entry,) = engine.look_ahead()
    _, _, states = reference_round(engine.model, seq.tokens, seq.hidden, k, True,
                                   forced=exact.tokens.tolist())
    verify = exact.tokens.tolist()
    chain = [entry.outcome[-1], *entry.drafts.tokens.tolist()]  # what the steps drew
    _, logits, _ = reference_round(engine.model, seq.tokens + verify,
                                   torch.cat([seq.hidden, states]), k, True, forced=chain)
    for i in range(k - 1):  # draft i of the entry is step i + 2's sample
        top, support = (logits[i + 1] / temp).topk(top_k)
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
    assert [e.seq_id for e in engine.look_ahead()] == [1]
    upd = b.extend(rng, 1)
    bad = SeqUpdate(1, upd.start, upd.tokens, upd.hidden, look_ahead=True,
                    verifying=(1, 2, 3))  # K = 2
    (failure,) = engine.update([bad])
    assert failure.code == "INVALID_ARGUMENT" and "verifying" in failure.message

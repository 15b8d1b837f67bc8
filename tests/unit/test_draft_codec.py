"""Draft stream messages: dataclass round trips and per-sequence validation."""

from __future__ import annotations

import grpc
import pytest
import torch

from chainspec.engine.draft_types import (
    DraftReply,
    DraftResult,
    DraftSampling,
    ErrorCode,
    SeqFailure,
    SeqUpdate,
    UpdateBatch,
)
from chainspec.rpc import draft_codec as dc
from chainspec.rpc.generated.v1 import drafter_pb2 as pb

H, V, K = 8, 100, 3
LIMITS = dc.DraftLimits(hidden_size=H, vocab_size=V, num_draft_tokens=K, max_rows=16,
                        max_top_k=4)


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def _update(seq_id=1, n=2, **kw) -> SeqUpdate:
    return SeqUpdate(seq_id, kw.pop("start", 5), tuple(range(10, 10 + n)), torch.randn(n, H), **kw)


def test_request_round_trip() -> None:
    sampled = DraftSampling(0.75, top_k=4, seed=0)  # seed 0 is a seed, not "unset"
    batch = UpdateBatch(7, (_update(1), _update(2, 1, want_drafts=False),
                           _update(3, 4, sampling=sampled),
                           _update(4, sampling=DraftSampling(0.5, 2))), releases=(9, 11))
    back, failures = dc.decode_draft_request(_wire(dc.encode_draft_request(batch)), LIMITS)
    assert failures == () and back.batch_id == 7 and back.releases == (9, 11)
    for a, b in zip(batch.updates, back.updates, strict=True):
        assert (a.seq_id, a.start, a.tokens, a.want_drafts, a.sampling) == \
               (b.seq_id, b.start, b.tokens, b.want_drafts, b.sampling)
        assert torch.equal(a.hidden, b.hidden)
    assert back.updates[3].sampling.seed is None


def test_the_depth_asked_travels_and_fewer_drafts_come_back() -> None:
    """Drafter-side depth (DESIGN 4.11): num_drafts goes over the wire (0: K), and an
    answer of 1..K drafts decodes, greedy and sampled."""
    batch = UpdateBatch(2, (_update(1, num_drafts=2), _update(2), _update(3, num_drafts=K)))
    back, _ = dc.decode_draft_request(_wire(dc.encode_draft_request(batch)), LIMITS)
    assert [u.num_drafts for u in back.updates] == [2, 0, K]
    short = DraftResult(1, 9, torch.tensor([4]))
    sampled = _sampled(seq_id=2)
    two = DraftResult(2, 12, sampled.tokens[:2], sampled.support[:2], sampled.probs[:2])
    reply = dc.decode_draft_response(_wire(dc.encode_draft_response(
        DraftReply(3, (short, DraftResult(3, 7, torch.tensor([1, 2, 3])), two)))), LIMITS)
    got = [r.tokens.tolist() for r in reply.results]
    assert got == [[4], [1, 2, 3], sampled.tokens[:2].tolist()]
    assert torch.equal(reply.results[2].probs, two.probs)


def test_request_hidden_wire_dtype() -> None:
    u = _update(n=4)
    msg = dc.encode_draft_request(UpdateBatch(1, (u,)), hidden_dtype="int8")
    assert msg.updates[0].hidden.dtype == pb.chainspec_dot_v1_dot_tensor__pb2.DTYPE_INT8
    back, _ = dc.decode_draft_request(_wire(msg), LIMITS)
    assert torch.allclose(back.updates[0].hidden, u.hidden, atol=u.hidden.abs().max() / 200)


@pytest.mark.parametrize("wire", ["f32", "bf16", "int8", "fp8_e4m3"])
def test_batch_encoding_equals_per_update_encoding(wire) -> None:
    """The batch is quantized once; per-row scales make each slice its own encoding."""
    updates = (_update(1, 3), _update(2, 1), _update(3, 5))
    msg = dc.encode_draft_request(UpdateBatch(1, updates), hidden_dtype=wire)
    for u, m in zip(updates, msg.updates, strict=True):
        assert m == dc.encode_update(u, hidden_dtype=wire)


def test_decoded_batch_hidden_are_writable() -> None:
    batch = UpdateBatch(1, (_update(1, 3), _update(2, 2)))
    back, _ = dc.decode_draft_request(_wire(dc.encode_draft_request(batch)), LIMITS)
    for u in back.updates:
        u.hidden.mul_(2)  # owned memory, not the message's bytes
    assert torch.equal(back.updates[1].hidden, 2 * batch.updates[1].hidden)
    assert dc.decode_draft_request(pb.DraftRequest(releases=[4]), LIMITS)[0].updates == ()


def _bad_update(edit) -> pb.SequenceUpdate:
    msg = dc.encode_update(_update(seq_id=5, n=2, sampling=DraftSampling(1.0, 2)))
    edit(msg)
    return msg


# (case, edit of an encoded update, words the per-sequence error must contain)
BAD_UPDATES = [
    ("token out of vocab", lambda m: m.tokens.__setitem__(1, V), "tokens[1] = 100 is out of"),
    ("no tokens", lambda m: m.ClearField("tokens"), "tokens: needs at least 1 token"),
    ("tokens vs rows", lambda m: m.tokens.append(3), "3 tokens but 2 hidden rows"),
    ("no hidden", lambda m: m.ClearField("hidden"), "hidden: missing"),
    ("wrong hidden size", lambda m: m.hidden.shape.__setitem__(1, H + 1), "expected shape [n, 8]"),
    ("nan hidden", lambda m: m.hidden.CopyFrom(
        dc.encode_tensor(torch.full((2, H), float("nan")))), "non-finite value nan"),
    ("int32 hidden", lambda m: m.hidden.CopyFrom(dc.encode_tensor(torch.ones(2, H).int())),
     "hidden: dtype INT32 is not allowed here; expected one of F32, F16, BF16, INT8"),
    ("too many rows", lambda m: (m.ClearField("tokens"), m.tokens.extend([1] * 17),
                                 m.hidden.CopyFrom(dc.encode_tensor(torch.zeros(17, H)))),
     "17 rows exceed the limit of 16"),
    ("nan temperature", lambda m: setattr(m.sampling, "temperature", float("nan")),
     "sampling.temperature: must be finite"),
    ("negative temperature", lambda m: setattr(m.sampling, "temperature", -1.0),
     "sampling.temperature"),
    ("top_k 0", lambda m: setattr(m.sampling, "top_k", 0), "sampling.top_k: sampled drafts"),
    ("top_k too big", lambda m: setattr(m.sampling, "top_k", 5), "1 <= top_k <= 4, got 5"),
    ("depth past K", lambda m: setattr(m, "num_drafts", K + 1), "num_drafts: 4; at most K = 3"),
]


@pytest.mark.parametrize("case, edit, words", BAD_UPDATES, ids=[c[0] for c in BAD_UPDATES])
def test_bad_update_fails_only_its_sequence(case, edit, words) -> None:
    good = dc.encode_update(_update(seq_id=4))
    msg = pb.DraftRequest(batch_id=3, updates=[good, _bad_update(edit), good])
    msg.updates[2].seq_id = 6
    batch, failures = dc.decode_draft_request(_wire(msg), LIMITS)
    assert [u.seq_id for u in batch.updates] == [4, 6]
    (f,) = failures
    assert (f.seq_id, f.code, f.expected_start) == (5, ErrorCode.INVALID_ARGUMENT, None)
    assert words in f.message and "updates[1]" in f.message


def test_duplicate_seq_id_fails_the_second_update() -> None:
    u = dc.encode_update(_update(seq_id=4))
    batch, failures = dc.decode_draft_request(pb.DraftRequest(updates=[u, u]), LIMITS)
    assert len(batch.updates) == 1 and failures[0].seq_id == 4
    assert "more than one update" in failures[0].message


def _sampled(seq_id=1, k=2) -> DraftResult:
    support = torch.tensor([[5, 9], [1, 2], [7, 99]])[:, :k]  # [K, k]
    probs = torch.softmax(torch.randn(K, k), dim=-1)  # [K, k]
    return DraftResult(seq_id, 12, support[:, 0].clone(), support, probs, draft_time_s=0.25)


def test_response_round_trip() -> None:
    greedy = DraftResult(1, 12, torch.tensor([3, 4, 5]), draft_time_s=0.5)
    results = (greedy, _sampled(2),
               SeqFailure(3, ErrorCode.FAILED_PRECONDITION, "start 9, expected 0", 0),
               SeqFailure(4, ErrorCode.RESOURCE_EXHAUSTED, "full"))
    reply = dc.decode_draft_response(_wire(dc.encode_draft_response(DraftReply(8, results))),
                                     LIMITS)
    assert reply.batch_id == 8
    g, s, f0, f1 = reply.results
    assert (g.seq_id, g.position, g.tokens.tolist(), g.support, g.draft_time_s) == \
           (1, 12, [3, 4, 5], None, 0.5)
    assert torch.equal(s.support, results[1].support) and s.support.dtype == torch.int64
    assert torch.equal(s.probs, results[1].probs) and torch.equal(s.tokens, results[1].tokens)
    assert f0 == results[2] and f0.expected_start == 0  # 0 survives (proto3 optional)
    assert f1 == results[3] and f1.expected_start is None


def _bad_drafts(edit) -> pb.SequenceResult:
    msg = dc.encode_result(_sampled(seq_id=7))
    edit(msg.drafts)
    return msg


def _probs(rows) -> pb.chainspec_dot_v1_dot_tensor__pb2.Tensor:
    return dc.encode_tensor(torch.tensor(rows, dtype=torch.float32))


BAD_DRAFTS = [
    ("no drafts", lambda d: d.ClearField("tokens"), "expected 1..K = 3 drafts, got 0"),
    ("fewer drafts than support rows", lambda d: d.tokens.pop(),
     "support: expected shape [2, k], got [3, 2]"),
    ("draft out of vocab", lambda d: d.tokens.__setitem__(0, V), "tokens[0] = 100 is out of"),
    ("support without probs", lambda d: d.ClearField("probs"), "both be set or both be absent"),
    ("support shape", lambda d: d.support.CopyFrom(dc.encode_tensor(torch.zeros(2, 2).int())),
     "support: expected shape [3, k], got [2, 2]"),
    ("probs cols", lambda d: d.probs.CopyFrom(_probs([[1.0]] * 3)), "probs: expected shape [n, 2]"),
    ("probs rows", lambda d: d.probs.CopyFrom(_probs([[0.5, 0.5]] * 2)), "expected shape [3, 2]"),
    ("support id out of vocab", lambda d: d.support.CopyFrom(
        dc.encode_tensor(torch.tensor([[5, 9], [1, 2], [7, 100]]))), "support: token ids"),
    ("k too big", lambda d: (d.support.CopyFrom(dc.encode_tensor(torch.ones(3, 5).int())),
                             d.probs.CopyFrom(_probs([[0.2] * 5] * 3))), "k = 5 exceeds"),
    ("negative prob", lambda d: d.probs.CopyFrom(_probs([[1.5, -0.5]] * 3)), "in [0, 1]"),
    ("row sum", lambda d: d.probs.CopyFrom(_probs([[0.5, 0.4]] * 3)), "rows must sum to 1"),
    ("draft not in support", lambda d: d.tokens.__setitem__(1, 50),
     "tokens[1] = 50 has no probability"),
    ("draft with zero prob", lambda d: d.probs.CopyFrom(_probs([[0.0, 1.0]] + [[0.5, 0.5]] * 2)),
     "tokens[0] = 5 has no probability"),
    ("nan probs", lambda d: d.probs.CopyFrom(_probs([[float("nan"), 1.0]] * 3)), "non-finite"),
    ("float support", lambda d: d.support.CopyFrom(dc.encode_tensor(
        torch.tensor([[5.0, 9.0], [1.0, 2.0], [7.0, 99.0]]))), "support: dtype F32 is not allowed"),
    ("bf16 probs", lambda d: d.probs.CopyFrom(dc.encode_tensor(torch.full((3, 2), 0.5), "bf16")),
     "probs: dtype BF16 is not allowed"),
]


@pytest.mark.parametrize("case, edit, words", BAD_DRAFTS, ids=[c[0] for c in BAD_DRAFTS])
def test_bad_drafts_become_failures(case, edit, words) -> None:
    good = dc.encode_result(DraftResult(1, 3, torch.tensor([1, 2, 3])))
    msg = pb.DraftResponse(batch_id=2, results=[good, _bad_drafts(edit)])
    ok, bad = dc.decode_draft_response(_wire(msg), LIMITS).results
    assert isinstance(ok, DraftResult) and isinstance(bad, SeqFailure)
    assert (bad.seq_id, bad.code) == (7, ErrorCode.INVALID_ARGUMENT)
    assert words in bad.message and "results[1].drafts" in bad.message


@pytest.mark.parametrize("code", [0, 5, 99])
def test_unknown_error_code_means_no_drafts_not_resync(code) -> None:
    msg = pb.DraftResponse(results=[pb.SequenceResult(
        error=pb.SequenceError(seq_id=3, code=code, message="boom"))])
    (f,) = dc.decode_draft_response(_wire(msg), LIMITS).results
    assert f.code is ErrorCode.UNAVAILABLE and "boom" in f.message


def test_error_codes_agree_with_grpc_and_the_proto() -> None:
    for code in ErrorCode:
        assert grpc.StatusCode[code.value].value[0] == pb.ErrorCode.Value(f"ERROR_CODE_{code}")
    assert len(ErrorCode) == len(pb.ErrorCode.values()) - 1


@pytest.mark.parametrize("make, match", [
    (lambda: DraftSampling(temperature=-1), "temperature"),
    (lambda: DraftSampling(temperature=1.0, top_k=0), "top_k"),
    (lambda: SeqUpdate(1, 0, (1, 2), torch.zeros(3, H)), "2 tokens need hidden"),
    (lambda: SeqUpdate(1, 0, (), torch.zeros(0, H)), "0 tokens"),
    (lambda: DraftResult(1, 0, torch.tensor([1, 2]), support=torch.zeros(2, 2)), "together"),
    (lambda: DraftResult(1, 0, torch.tensor([1, 2]), torch.zeros(3, 2), torch.zeros(3, 2)),
     r"must both be \[K, k\], K = 2"),
])
def test_dataclasses_reject_bad_shapes(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()

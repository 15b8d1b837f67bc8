"""The batched draft codec (one decode for a whole request or reply) against the
one-message-at-a-time reference: same values, and a bad entry still fails alone, with
the message the per-entry decoder gives it."""

from __future__ import annotations

import math

import numpy as np
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
from chainspec.rpc import codec
from chainspec.rpc import draft_codec as dc
from chainspec.rpc.generated.v1 import drafter_pb2 as pb
from chainspec.rpc.generated.v1 import tensor_pb2 as tensor_pb

H, V, K = 8, 100, 3
LIMITS = dc.DraftLimits(hidden_size=H, vocab_size=V, num_draft_tokens=K, max_rows=16,
                        max_top_k=4)
WIRES = [codec.WireDType.F32, codec.WireDType.F16, codec.WireDType.BF16,
         codec.WireDType.INT8, codec.WireDType.FP8_E4M3]


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def _assert_one_buffer(blocks: list[torch.Tensor]) -> None:
    """Consecutive row blocks of one buffer (one copy off the wire, not one per block)."""
    ptr = blocks[0].data_ptr()
    for b in blocks:
        assert b.data_ptr() == ptr and b.is_contiguous()
        ptr += b.numel() * b.element_size()


def _batch(sizes, seed=0) -> UpdateBatch:
    g = torch.Generator().manual_seed(seed)
    return UpdateBatch(3, tuple(SeqUpdate(10 + i, 4, tuple(range(1, n + 1)),
                                         torch.randn(n, H, generator=g))
                               for i, n in enumerate(sizes)))


@pytest.mark.parametrize("wire", WIRES)
def test_packed_rows_equal_per_tensor_decode(wire) -> None:
    msgs = [codec.encode_tensor(torch.randn(n, H) * 3, wire) for n in (1, 4, 2)]
    heads = [codec.tensor_header(m, expect_cols=H) for m in msgs]
    packed = codec.packed_rows(wire, H, [d for _, _, d in heads], [1, 4, 2],
                               [m.scales for m in msgs] if wire.quantized else ())
    for got, m in zip(packed, msgs, strict=True):
        assert got.dtype == torch.float32 and got.shape == (len(m.data) // (
            H * wire.itemsize), H)
        assert torch.equal(got, codec.decode_tensor(m))
    _assert_one_buffer(packed)
    packed[1] += 1  # writable: SeqUpdate.hidden views of it may be used in place


@pytest.mark.parametrize("wire", WIRES)
def test_packed_rows_refuse_a_bad_value_or_scale(wire) -> None:
    good = codec.encode_tensor(torch.randn(2, H), wire)
    bad = codec.encode_tensor(torch.randn(2, H), wire)
    if wire.quantized:
        bad.scales = np.array([1.0, -1.0], "<f4").tobytes()
    else:
        x = torch.randn(2, H)
        x[1, 3] = math.nan
        bad = codec.encode_tensor(x, wire)
    scales = [good.scales, bad.scales] if wire.quantized else ()
    assert codec.packed_rows(wire, H, [good.data, bad.data], [2, 2], scales) is None


def test_tensor_header_checks_what_decode_array_checks() -> None:
    msg = codec.encode_tensor(torch.randn(2, H), codec.WireDType.F32)
    msg.scales = b"\0" * 8
    with pytest.raises(codec.WireError, match="takes no scales"):
        codec.tensor_header(msg, name="h")
    with pytest.raises(codec.WireError, match="takes no scales"):
        codec.decode_array(msg, name="h")
    short = tensor_pb.Tensor(shape=[2, H], dtype=codec.WireDType.F32.value, data=b"\0" * 8)
    with pytest.raises(codec.WireError, match="needs 64 bytes of data, got 8"):
        codec.tensor_header(short, name="h", expect_cols=H)


@pytest.mark.parametrize("wire", [codec.WireDType.F32, codec.WireDType.INT8])
def test_fill_blocks_equals_row_slices(wire) -> None:
    rows = codec.encode_rows(torch.randn(7, H), wire)
    blocks = [tensor_pb.Tensor() for _ in range(3)]
    rows.fill_blocks(blocks, [1, 4, 2])
    r0 = 0
    for got, n in zip(blocks, [1, 4, 2], strict=True):
        want = tensor_pb.Tensor()
        rows.fill(want, r0, r0 + n)
        assert got == want
        r0 += n
    with pytest.raises(ValueError, match="2-d"):
        codec.encode_rows(torch.randn(2, 2, H)).fill_blocks([tensor_pb.Tensor()], [4])


def test_request_hidden_is_one_packed_buffer() -> None:
    batch = _batch([1, 4, 2])
    back, failures = dc.decode_draft_request(_wire(dc.encode_draft_request(batch)), LIMITS)
    assert failures == ()
    _assert_one_buffer([u.hidden for u in back.updates])
    for u, want in zip(back.updates, batch.updates, strict=True):
        assert torch.equal(u.hidden, want.hidden) and u.tokens == want.tokens


def test_request_with_mixed_dtypes_decodes_each() -> None:
    batch = _batch([2, 3])
    msg = dc.encode_draft_request(batch)
    msg.updates[1].hidden.CopyFrom(codec.encode_tensor(batch.updates[1].hidden,
                                                       codec.WireDType.F16))
    back, failures = dc.decode_draft_request(_wire(msg), LIMITS)
    assert failures == () and torch.equal(back.updates[0].hidden, batch.updates[0].hidden)
    assert torch.allclose(back.updates[1].hidden, batch.updates[1].hidden, atol=1e-2)


@pytest.mark.parametrize("wire", [codec.WireDType.F32, codec.WireDType.INT8])
def test_request_with_a_bad_row_fails_that_update_alone(wire) -> None:
    batch = _batch([2, 3, 1])
    msg = dc.encode_draft_request(batch, wire)
    if wire.quantized:
        msg.updates[1].hidden.scales = np.array([1.0, math.inf, 1.0], "<f4").tobytes()
        want = "updates[1].hidden.scales: scale inf of row 1"
    else:
        bad = batch.updates[1].hidden.clone()
        bad[2, 5] = math.inf
        msg.updates[1].hidden.CopyFrom(codec.encode_tensor(bad))
        want = f"updates[1].hidden: non-finite value inf at flat index {2 * H + 5}"
    back, failures = dc.decode_draft_request(_wire(msg), LIMITS)
    assert [u.seq_id for u in back.updates] == [10, 12]
    assert len(failures) == 1 and failures[0].seq_id == 11
    assert failures[0].code is ErrorCode.INVALID_ARGUMENT and want in failures[0].message
    assert torch.allclose(back.updates[1].hidden, batch.updates[2].hidden, atol=0.05)


def test_scales_are_counted_per_update_not_per_batch() -> None:
    """One update one scale short, the next one scale over: the batch's total matches,
    yet both must fail, each naming its own field."""
    batch = _batch([3, 2])
    msg = dc.encode_draft_request(batch, codec.WireDType.INT8)
    a, b = msg.updates[0].hidden, msg.updates[1].hidden
    a.scales, b.scales = a.scales[:8], b.scales + a.scales[8:]
    back, failures = dc.decode_draft_request(_wire(msg), LIMITS)
    assert back.updates == ()
    assert [f.seq_id for f in failures] == [10, 11]
    assert "updates[0].hidden.scales: 3 rows need 12 bytes" in failures[0].message
    assert "updates[1].hidden.scales: 2 rows need 8 bytes" in failures[1].message


def _results():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(K, 4, generator=g), dim=1)
    support = torch.tensor([[5, 6, 7, 8]] * K)
    return (DraftResult(1, 9, torch.tensor([5, 6, 7]), draft_time_s=0.5),
            SeqFailure(2, ErrorCode.FAILED_PRECONDITION, "resync", 0),
            DraftResult(3, 11, torch.tensor([1, 2, 3])),
            DraftResult(4, 12, torch.tensor([5, 6, 7]), support, probs),
            SeqFailure(5, ErrorCode.RESOURCE_EXHAUSTED, "full"),
            DraftResult(6, 13, torch.tensor([9, 8, 7])))


def test_response_equals_per_result_encoding_and_round_trips() -> None:
    reply = DraftReply(4, _results())
    msg = dc.encode_draft_response(reply)
    assert msg == pb.DraftResponse(batch_id=4, results=[dc.encode_result(r)
                                                        for r in reply.results])
    back = dc.decode_draft_response(_wire(msg), LIMITS)
    assert back.batch_id == 4 and len(back.results) == len(reply.results)
    for got, want in zip(back.results, reply.results, strict=True):
        assert type(got) is type(want) and got.seq_id == want.seq_id
        if isinstance(want, DraftResult):
            assert torch.equal(got.tokens, want.tokens) and got.tokens.dtype == torch.int64
            assert got.position == want.position and got.sampled == want.sampled
        else:
            assert got == want


def test_response_with_a_bad_greedy_draft_fails_it_alone() -> None:
    msg = dc.encode_draft_response(DraftReply(4, _results()))
    msg.results[2].drafts.tokens[1] = V  # out of range
    msg.results[5].drafts.tokens.append(1)  # K + 1 drafts
    back = dc.decode_draft_response(_wire(msg), LIMITS)
    kinds = [type(r).__name__ for r in back.results]
    assert kinds == ["DraftResult", "SeqFailure", "SeqFailure", "DraftResult", "SeqFailure",
                     "SeqFailure"]
    assert back.results[2].code is ErrorCode.INVALID_ARGUMENT
    assert "results[2].drafts.tokens[1] = 100 is out of range" in back.results[2].message
    assert "results[5].drafts.tokens: expected 1..K = 3 drafts, got 4" in back.results[5].message
    assert torch.equal(back.results[0].tokens, torch.tensor([5, 6, 7]))


def test_sampled_updates_keep_their_sampling() -> None:
    s = DraftSampling(0.5, 3, seed=2 ** 64 - 1)
    batch = UpdateBatch(1, (SeqUpdate(1, 0, (1, 2), torch.randn(2, H), True, s),
                           SeqUpdate(2, 0, (3,), torch.randn(1, H))))
    back, _ = dc.decode_draft_request(_wire(dc.encode_draft_request(batch)), LIMITS)
    assert [u.sampling for u in back.updates] == [s, DraftSampling()]

"""Tensor codec: round trips for every dtype, quantization error bounds, strict decoding."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from chainspec.rpc.codec import (
    FLOAT_DTYPES,
    WireDType,
    WireError,
    check_tokens,
    decode_tensor,
    encode_rows,
    encode_tensor,
)
from chainspec.rpc.generated.v1 import tensor_pb2 as tensor_pb

SHAPES = [(0, 8), (1, 1), (3, 5), (7,), (2, 3, 4), (4, 0)]
FLOATS = [WireDType.F32, WireDType.F16, WireDType.BF16]


def _x(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitude, so per-row scaling matters
    x = torch.randn(shape, generator=g)
    if x.dim() >= 2 and x.shape[0] > 1:
        x = x * torch.logspace(-4, 3, x.shape[0]).reshape(-1, *[1] * (x.dim() - 1))
    return x


def _reencode(msg: tensor_pb.Tensor) -> tensor_pb.Tensor:
    return tensor_pb.Tensor.FromString(msg.SerializeToString())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("wire", list(WireDType))
def test_round_trip_shape_and_dtype(shape, wire) -> None:
    x = torch.randint(-1000, 1000, shape) if wire is WireDType.INT32 else _x(shape)
    msg = _reencode(encode_tensor(x, wire))
    assert msg.dtype == wire.value and tuple(msg.shape) == shape
    assert len(msg.data) == x.numel() * wire.itemsize
    rows = x.numel() // shape[-1] if shape[-1] else int(np.prod(shape[:-1]))
    assert len(msg.scales) == (4 * rows if wire.quantized else 0)
    y = decode_tensor(msg)
    assert y.shape == x.shape
    assert y.dtype == (torch.int64 if wire is WireDType.INT32 else torch.float32)
    if wire is WireDType.F32 or wire is WireDType.INT32:
        assert torch.equal(y, x)
    elif wire is WireDType.F16:
        assert torch.equal(y, x.half().float())
    elif wire is WireDType.BF16:
        assert torch.equal(y, x.bfloat16().float())


def test_bytes_are_little_endian_and_bf16_is_exact() -> None:
    x = _x((5, 16))
    assert encode_tensor(x).data == np.asarray(x.numpy(), dtype="<f4").tobytes()
    b = x.bfloat16()
    msg = encode_tensor(b)  # default wire dtype of a bf16 tensor is BF16
    assert msg.dtype == tensor_pb.DTYPE_BF16
    assert msg.data == np.asarray(b.view(torch.int16).numpy(), dtype="<i2").tobytes()
    assert encode_tensor(x, "bf16").data == msg.data  # f32 -> bf16 rounds like torch
    back = decode_tensor(msg, dtype=torch.bfloat16)
    assert torch.equal(back.view(torch.int16), b.view(torch.int16))  # bit-exact


def _row_absmax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=-1, keepdim=True)


def test_int8_error_is_half_a_step_of_the_row_absmax() -> None:
    x = _x((64, 256))
    y = decode_tensor(encode_tensor(x, "int8"))
    bound = _row_absmax(x) / 254 * (1 + 1e-5)  # |x - q s| <= s / 2, s = absmax / 127
    assert ((y - x).abs() <= bound).all()
    assert torch.allclose(_row_absmax(y), _row_absmax(x), rtol=1e-6)  # absmax survives
    err = (y - x).abs() / _row_absmax(x)
    assert err.max() < 1 / 254 + 1e-6 and err.mean() < 1 / 400


def test_fp8_error_is_relative_with_a_subnormal_floor() -> None:
    x = _x((64, 256))
    y = decode_tensor(encode_tensor(x, "fp8_e4m3"))
    scale = _row_absmax(x) / 448
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 (floor 2^-10 s)
    bound = torch.maximum(x.abs() / 16, scale / 1024) * (1 + 1e-5)
    assert ((y - x).abs() <= bound).all()
    assert ((y - x).abs() <= _row_absmax(x) / 16).all()


@pytest.mark.parametrize("wire", ["int8", "fp8_e4m3"])
def test_quantized_zero_rows_and_extremes(wire) -> None:
    x = torch.tensor([[0.0, 0.0, 0.0], [1e30, -1e30, 1.0], [1e-30, 0.0, -1e-30],
                      [1e-40, 0.0, -1e-40]])  # last row: subnormal absmax
    msg = encode_tensor(x, wire)
    scales = np.frombuffer(msg.scales, dtype="<f4")
    assert scales[0] == 0
    y = decode_tensor(msg)
    assert torch.equal(y[0], torch.zeros(3))
    assert torch.allclose(y[1:3, :2], x[1:3, :2], rtol=1e-6)
    assert torch.allclose(y[3], x[3], rtol=1e-2, atol=0)  # subnormal: less precise, finite
    assert y.isfinite().all()


def test_decode_options_and_ownership() -> None:
    x = _x((3, 4))
    y = decode_tensor(encode_tensor(x), dtype=torch.float16, expect_cols=4, max_rows=3)
    assert y.dtype == torch.float16
    z = decode_tensor(encode_tensor(x))
    z += 1  # fresh and writable: never a view of the message's bytes
    assert torch.equal(decode_tensor(encode_tensor(x.t())), x.t())  # non-contiguous input


def test_row_slices_encode_like_the_rows_alone() -> None:
    x = _x((5, 4))
    rows = encode_rows(x, "int8")
    part = tensor_pb.Tensor()
    rows.fill(part, 1, 3)
    assert part == encode_tensor(x[1:3], "int8")
    with pytest.raises(ValueError, match="row slices need a 2-d tensor"):
        encode_rows(_x((2, 3, 4))).fill(tensor_pb.Tensor(), 0, 1)


@pytest.mark.parametrize("t, wire, match", [
    (torch.tensor(1.0), None, "0-d"),
    (torch.zeros(2, dtype=torch.bool), None, "no default wire dtype"),
    (torch.zeros(2), "int4", "unknown wire dtype 'int4'"),
    (torch.zeros(2), WireDType.INT32, "needs an integer tensor"),
])
def test_encode_rejects_misuse(t, wire, match) -> None:
    with pytest.raises(ValueError, match=match):
        encode_tensor(t, wire)


def _msg(shape, dtype=tensor_pb.DTYPE_F32, nbytes=None, scales=b"", fill=None):
    n = int(np.prod(shape)) if shape else 0
    item = {1: 4, 2: 2, 3: 2, 4: 1, 5: 1, 6: 4}.get(dtype, 4)
    data = bytearray(n * item if nbytes is None else nbytes)
    if fill is not None:
        data[: len(fill)] = fill
    return tensor_pb.Tensor(data=bytes(data), shape=shape, dtype=dtype, scales=scales)


_NAN_F32 = np.array([np.nan], dtype="<f4").tobytes()
_INF_BF16 = np.array([0x7F80], dtype="<u2").tobytes()
_ONE_SCALE = np.ones(1, dtype="<f4").tobytes()

# (case, message, decode kwargs, words the error must contain)
BAD_TENSORS = [
    ("unknown dtype", _msg([2], dtype=99), {}, "unknown dtype 99"),
    ("unspecified dtype", _msg([2], dtype=0), {}, "unknown dtype 0"),
    ("short data", _msg([3, 4], nbytes=44), {}, "needs 48 bytes of data, got 44"),
    ("long data", _msg([3, 4], dtype=3, nbytes=25), {}, "needs 24 bytes of data, got 25"),
    ("rank 0", _msg([]), {}, "rank must be >= 1"),
    ("wrong hidden size", _msg([3, 4]), {"expect_cols": 8}, "expected shape [n, 8], got [3, 4]"),
    ("rank 3 hidden", _msg([2, 3, 4]), {"expect_cols": 4}, "expected shape [n, 4], got [2, 3, 4]"),
    ("rank 1 hidden", _msg([4]), {"expect_cols": 4}, "expected shape [n, 4], got [4]"),
    ("too many rows", _msg([5, 4]), {"max_rows": 4}, "5 rows exceed the limit of 4"),
    ("nan f32", _msg([2, 2], fill=_NAN_F32), {}, "non-finite value nan at flat index 0"),
    ("inf bf16", _msg([2, 2], dtype=3, fill=b"\0\0" + _INF_BF16), {},
     "non-finite value inf at flat index 1"),
    ("nan fp8", _msg([1, 2], dtype=5, fill=b"\0\x7f", scales=_ONE_SCALE), {},
     "non-finite value nan at flat index 1"),
    ("missing scales", _msg([3, 4], dtype=4), {}, "scales: 3 rows need 12 bytes"),
    ("short scales", _msg([3, 4], dtype=5, scales=b"\0" * 8), {}, "3 rows need 12 bytes"),
    ("nan scale", _msg([2, 1], dtype=4, scales=b"\0" * 4 + _NAN_F32), {}, "scale nan of row 1"),
    ("negative scale", _msg([1, 1], dtype=4, scales=np.array([-1], "<f4").tobytes()), {},
     "scale -1.0 of row 0"),
    ("scales on f32", _msg([1, 1], scales=_ONE_SCALE), {}, "F32 data takes no scales"),
    ("int32 where floats", _msg([1, 2], dtype=6), {"allowed": FLOAT_DTYPES},
     "dtype INT32 is not allowed here; expected one of F32, F16, BF16, INT8, FP8_E4M3"),
]


@pytest.mark.parametrize("case, msg, kwargs, words", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_decode_rejects_bad_tensors(case, msg, kwargs, words) -> None:
    with pytest.raises(WireError) as info:
        decode_tensor(msg, name="updates[2].hidden", **kwargs)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.message and "updates[2].hidden" in info.value.message


def test_nonfinite_allowed_when_asked() -> None:
    y = decode_tensor(_msg([1, 1], fill=_NAN_F32), finite=False)
    assert y.isnan().all()


BAD_TOKENS = [
    ([5, 99, 100, 7], 100, 0, "tokens[2] = 100 is out of range for vocab size 100"),
    ([2**32 - 1], 100, 0, "tokens[0] = 4294967295 is out of range"),
    ([], 100, 1, "tokens: needs at least 1 token(s), got 0"),
]


@pytest.mark.parametrize("ids, vocab, min_count, words", BAD_TOKENS)
def test_check_tokens_rejects(ids, vocab, min_count, words) -> None:
    with pytest.raises(WireError) as info:
        check_tokens(ids, vocab, min_count=min_count)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and words in info.value.message


def test_check_tokens_accepts() -> None:
    assert check_tokens((0, 99), 100, min_count=2) == [0, 99]


def test_wire_dtypes_match_the_proto_enum() -> None:
    for d in WireDType:
        assert tensor_pb.DType.Name(d.value) == f"DTYPE_{d.name}"
    assert len(WireDType) == len(tensor_pb.DType.values()) - 1  # all but UNSPECIFIED

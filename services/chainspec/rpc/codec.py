"""Tensor codec: torch tensors to and from `chainspec.v1.Tensor`, with strict validation.

Data travel as raw little-endian bytes (numpy views; no Python loops over elements).
Quantized dtypes carry one float32 scale per row (rows = prod(shape[:-1])):
int8 is symmetric, scale = absmax / 127; fp8 e4m3 uses scale = absmax / 448.
Decoding never trusts the sender: any mismatch raises `WireError(INVALID_ARGUMENT, ...)`
with a message naming the field and the numbers.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from chainspec.kernels.hidden_quant import quantize_rows
from chainspec.rpc.generated.v1 import tensor_pb2 as tensor_pb


class WireError(Exception):
    """Input from the wire that cannot be used; `code` is the status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> WireError:
    return WireError(grpc.StatusCode.INVALID_ARGUMENT, message)


class WireDType(enum.Enum):
    """Element types on the wire; values are the proto enum numbers."""

    F32 = tensor_pb.DTYPE_F32
    F16 = tensor_pb.DTYPE_F16
    BF16 = tensor_pb.DTYPE_BF16
    INT8 = tensor_pb.DTYPE_INT8
    FP8_E4M3 = tensor_pb.DTYPE_FP8_E4M3
    INT32 = tensor_pb.DTYPE_INT32

    @classmethod
    def parse(cls, name: str | WireDType) -> WireDType:
        """`WireDType` from a config string ("bf16", "int8", "fp8_e4m3", ...)."""
        if isinstance(name, WireDType):
            return name
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown wire dtype {name!r}; known: "
                             f"{', '.join(d.name.lower() for d in cls)}") from None

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def quantized(self) -> bool:
        return self in (WireDType.INT8, WireDType.FP8_E4M3)


# What may carry real numbers (hidden states, probabilities): never INT32.
FLOAT_DTYPES = frozenset({WireDType.F32, WireDType.F16, WireDType.BF16, WireDType.INT8,
                          WireDType.FP8_E4M3})


_ITEMSIZE = {WireDType.F32: 4, WireDType.F16: 2, WireDType.BF16: 2, WireDType.INT8: 1,
             WireDType.FP8_E4M3: 1, WireDType.INT32: 4}
_DEFAULT_WIRE = {torch.float32: WireDType.F32, torch.float16: WireDType.F16,
                 torch.bfloat16: WireDType.BF16, torch.int32: WireDType.INT32,
                 torch.int64: WireDType.INT32}
_BY_NUMBER = {d.value: d for d in WireDType}
# All 256 e4m3fn codes as float32 (0x7f and 0xff are NaN), for a numpy-only decode.
_FP8_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(
    torch.float8_e4m3fn).float().numpy()


# ---------------------------------------------------------------------------- encode


@dataclass(frozen=True)
class EncodedRows:
    """A tensor encoded for the wire, on the host, as rows (rows = prod(shape[:-1])).

    Quantization is per row, so a block of rows sliced from here is exactly the encoding
    of those rows alone: a batch is encoded (and moved off the device) once, then split
    into per-sequence messages.
    """

    wire: WireDType
    shape: tuple[int, ...]
    data: np.ndarray  # [rows, cols * itemsize] uint8
    scales: np.ndarray | None  # [rows] little-endian float32, quantized dtypes only

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    def fill(self, out: tensor_pb.Tensor, r0: int = 0, r1: int | None = None) -> None:
        """Write rows [r0, r1) into the empty message `out` (all rows by default)."""
        r1 = self.num_rows if r1 is None else r1
        if (r0, r1) == (0, self.num_rows):
            out.shape.extend(self.shape)
        elif len(self.shape) == 2:
            out.shape.extend((r1 - r0, self.shape[1]))
        else:
            raise ValueError(f"row slices need a 2-d tensor, got shape {list(self.shape)}")
        out.dtype = self.wire.value
        out.data = self.data[r0:r1].tobytes()
        if self.scales is not None:
            out.scales = self.scales[r0:r1].tobytes()


    def fill_blocks(self, outs: Sequence[tensor_pb.Tensor], counts: Sequence[int]) -> None:
        """Write consecutive blocks of `counts` rows of a 2-d tensor into the empty
        messages `outs` (one host copy of the data, then a bytes slice per block)."""
        if len(self.shape) != 2:
            raise ValueError(f"row blocks need a 2-d tensor, got shape {list(self.shape)}")
        cols, row_bytes, wire = self.shape[1], self.data.shape[1], self.wire.value
        blob = self.data.tobytes()
        scales = None if self.scales is None else self.scales.tobytes()
        r0 = 0
        for out, n in zip(outs, counts, strict=True):
            out.shape.extend((n, cols))
            out.dtype = wire
            out.data = blob[r0 * row_bytes:(r0 + n) * row_bytes]
            if scales is not None:
                out.scales = scales[4 * r0:4 * (r0 + n)]
            r0 += n


def encode_rows(t: torch.Tensor, wire_dtype: WireDType | str | None = None) -> EncodedRows:
    """Encode `t` (rank >= 1, any device) as `wire_dtype` (default: its own dtype).

    Conversion and quantization run where `t` lives; one copy to the host at the end.
    """
    if t.dim() == 0:
        raise ValueError("cannot encode a 0-d tensor; the wire needs rank >= 1")
    wire = _DEFAULT_WIRE.get(t.dtype) if wire_dtype is None else WireDType.parse(wire_dtype)
    if wire is None:
        raise ValueError(f"no default wire dtype for {t.dtype}; pass wire_dtype")
    rows, cols = math.prod(t.shape[:-1]), t.shape[-1]
    scales = None
    if wire is WireDType.F32 and t.dtype == torch.float32 and t.device.type == "cpu":
        # NOTE: the common case in fewer torch ops; each costs tens of microseconds the
        # first time after an idle gap (measured), more than the copy itself
        data = np.ascontiguousarray(t.detach().numpy().reshape(rows, cols))
    else:
        x = t.detach().reshape(rows, cols)  # [rows, cols]
        if wire.quantized:
            x, scale = _quantize(x, wire)
            scales = scale.cpu().numpy().astype("<f4", copy=False)
        else:
            x = _convert(x, wire)
        data = x.contiguous().cpu().numpy()
    data = data.astype(data.dtype.newbyteorder("<"), copy=False).view(np.uint8)
    return EncodedRows(wire, tuple(t.shape), data.reshape(rows, cols * wire.itemsize), scales)


def encode_tensor(t: torch.Tensor, wire_dtype: WireDType | str | None = None,
                  out: tensor_pb.Tensor | None = None) -> tensor_pb.Tensor:
    """Encode `t` into a new message, or into the empty message `out` (no extra copy)."""
    out = tensor_pb.Tensor() if out is None else out
    encode_rows(t, wire_dtype).fill(out)
    return out


def _convert(x: torch.Tensor, wire: WireDType) -> torch.Tensor:
    if wire is WireDType.INT32:
        if x.is_floating_point():
            raise ValueError(f"INT32 wire dtype needs an integer tensor, got {x.dtype}")
        return x.to(torch.int32)
    if wire is WireDType.BF16:  # numpy has no bf16: move the bits as int16
        return x.to(torch.bfloat16).view(torch.int16)
    return x.to(torch.float32 if wire is WireDType.F32 else torch.float16)


def _quantize(x: torch.Tensor, wire: WireDType) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantization of x [rows, cols]: (codes [rows, cols], scales [rows]);
    a Triton kernel where x is on CUDA (kernels/hidden_quant), torch elsewhere."""
    if wire is WireDType.INT8:
        return quantize_rows(x, torch.int8)
    q, scale = quantize_rows(x, torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


# ---------------------------------------------------------------------------- decode


def decode_tensor(msg: tensor_pb.Tensor, *, name: str = "tensor",
                  expect_cols: int | None = None, max_rows: int | None = None,
                  dtype: torch.dtype | None = None, finite: bool = True,
                  allowed: Collection[WireDType] | None = None) -> torch.Tensor:
    """Decode and validate `msg`; returns a fresh, writable CPU tensor of `dtype`.

    Default dtype: float32 for float and quantized data, int64 for INT32. `expect_cols`
    requires shape [n, expect_cols]; `max_rows` bounds n; `finite` rejects NaN/Inf;
    `allowed` (default: any) are the wire dtypes the field may have.
    `name` is the field named in error messages ("updates[3].hidden").
    """
    arr = decode_array(msg, name=name, expect_cols=expect_cols, max_rows=max_rows,
                       finite=finite, allowed=allowed)
    out = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return out.to(dtype or _default_dtype(arr))


def to_tensors(arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """Decoded arrays with equal trailing shapes as tensors, in one copy: each is a view
    of one packed [sum(rows), ...] buffer (float32 or int64, as decode_tensor)."""
    if not arrays:
        return []
    packed = torch.from_numpy(np.concatenate(arrays))  # always a fresh, writable copy
    packed = packed.to(_default_dtype(arrays[0]))
    return list(torch.split(packed, [a.shape[0] for a in arrays]))


def _default_dtype(arr: np.ndarray) -> torch.dtype:
    return torch.int64 if arr.dtype == np.int32 else torch.float32


def decode_array(msg: tensor_pb.Tensor, *, name: str = "tensor",
                 expect_cols: int | None = None, max_rows: int | None = None,
                 finite: bool = True,
                 allowed: Collection[WireDType] | None = None) -> np.ndarray:
    """Validated elements of `msg` in its shape: float32, or int32 for INT32 data.

    The array may be a read-only view of the message's bytes; see decode_tensor.
    """
    wire, shape, data = tensor_header(msg, name=name, expect_cols=expect_cols,
                                      max_rows=max_rows, allowed=allowed)
    if wire.quantized:
        arr = _dequantize(data, msg.scales, wire, shape, name)
    else:
        arr = _plain_array(data, wire)
    if finite and wire is not WireDType.INT32 and not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise invalid(f"{name}: non-finite value {arr.flat[bad]} at flat index {bad} "
                      f"of shape {list(shape)}")
    return arr.reshape(shape)


def tensor_header(msg: tensor_pb.Tensor, *, name: str = "tensor",
                  expect_cols: int | None = None, max_rows: int | None = None,
                  allowed: Collection[WireDType] | None = None
                  ) -> tuple[WireDType, tuple[int, ...], bytes]:
    """The checks of `msg` that read no element (dtype, shape, byte and scale counts);
    returns (wire dtype, shape, data bytes). `decode_array` = these + the elements."""
    wire = _wire_dtype(msg, name)
    if allowed is not None and wire not in allowed:
        raise invalid(f"{name}: dtype {wire.name} is not allowed here; expected one of "
                      f"{', '.join(d.name for d in WireDType if d in allowed)}")
    shape = tuple(msg.shape)
    _check_shape(shape, name, expect_cols, max_rows)
    numel = math.prod(shape)
    data = msg.data  # NOTE: each field access copies the bytes; read it once
    if len(data) != numel * wire.itemsize:
        raise invalid(f"{name}: shape {list(shape)} of {wire.name} needs "
                      f"{numel * wire.itemsize} bytes of data, got {len(data)}")
    if not wire.quantized and msg.scales:
        raise invalid(f"{name}.scales: {wire.name} data takes no scales, got "
                      f"{len(msg.scales)} bytes")
    return wire, shape, data


def packed_rows(wire: WireDType, cols: int, data: Sequence[bytes], counts: Sequence[int],
                scales: Sequence[bytes] = ()) -> list[torch.Tensor] | None:
    """Float rows of several tensors whose headers passed `tensor_header` (`counts` rows
    each), decoded at once into one float32 buffer (one copy, one finiteness check);
    returns a [count, cols] view of it per tensor. None when any scale or element is bad,
    so the caller decodes them one by one to name the culprit."""
    joined = bytearray().join(data)  # NOTE: writable, so F32 needs no second copy
    rows = len(joined) // (cols * wire.itemsize)
    if wire.quantized:
        try:
            arr = _dequantize(joined, b"".join(scales), wire, (rows, cols), "rows")
        except WireError:
            return None
    else:
        arr = _plain_array(joined, wire)
    if not np.isfinite(arr).all():
        return None
    arr = arr.reshape(rows, cols)  # [sum(counts), cols]
    # NOTE: numpy slices + from_numpy, not torch.split: after an idle gap every distinct
    # torch op costs tens of microseconds the first time (measured), and this is one
    out, r0 = [], 0
    for n in counts:
        out.append(torch.from_numpy(arr[r0:r0 + n]))
        r0 += n
    return out


def _wire_dtype(msg: tensor_pb.Tensor, name: str) -> WireDType:
    wire = _BY_NUMBER.get(msg.dtype)  # NOTE: a dict, not WireDType(n): no enum machinery
    if wire is None:
        raise invalid(f"{name}: unknown dtype {msg.dtype}; known: "
                      f"{', '.join(f'{d.name}={d.value}' for d in WireDType)}")
    return wire


def _check_shape(shape: tuple[int, ...], name: str, expect_cols: int | None,
                 max_rows: int | None) -> None:
    if not shape:
        raise invalid(f"{name}: shape is empty; rank must be >= 1")
    if expect_cols is not None and (len(shape) != 2 or shape[1] != expect_cols):
        raise invalid(f"{name}: expected shape [n, {expect_cols}], got {list(shape)}")
    if max_rows is not None and shape[0] > max_rows:
        raise invalid(f"{name}: {shape[0]} rows exceed the limit of {max_rows}")


def _plain_array(data: bytes, wire: WireDType) -> np.ndarray:
    """float32 (int32 for INT32) elements; a read-only view when no conversion is needed."""
    if wire is WireDType.BF16:
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32)
        return (bits << 16).view(np.float32)
    np_dtype = {WireDType.F32: "<f4", WireDType.F16: "<f2", WireDType.INT32: "<i4"}[wire]
    out = np.int32 if wire is WireDType.INT32 else np.float32
    return np.frombuffer(data, dtype=np_dtype).astype(out, copy=False)


def _dequantize(data: bytes, scales_bytes: bytes, wire: WireDType, shape: tuple[int, ...],
                name: str) -> np.ndarray:
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    if len(scales_bytes) != rows * 4:
        raise invalid(f"{name}.scales: {rows} rows need {rows * 4} bytes of float32 scales, "
                      f"got {len(scales_bytes)}")
    scales = np.frombuffer(scales_bytes, dtype="<f4").astype(np.float32)  # [rows]
    ok = np.isfinite(scales) & (scales >= 0)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise invalid(f"{name}.scales: scale {scales[bad]} of row {bad} is not finite and >= 0")
    if wire is WireDType.INT8:
        q = np.frombuffer(data, dtype=np.int8).astype(np.float32)
    else:
        q = _FP8_TABLE[np.frombuffer(data, dtype=np.uint8)]
    q = q.reshape(rows, cols)
    q *= scales[:, None]
    return q.reshape(-1)


# ---------------------------------------------------------------------------- tokens


def check_tokens(ids: Sequence[int], vocab_size: int, *, name: str = "tokens",
                 min_count: int = 0) -> list[int]:
    """Validate token ids (< vocab_size, at least `min_count`); returns them as a list."""
    ids = list(ids)
    if len(ids) < min_count:
        raise invalid(f"{name}: needs at least {min_count} token(s), got {len(ids)}")
    if ids and max(ids) >= vocab_size:
        bad = next(i for i, t in enumerate(ids) if t >= vocab_size)
        raise invalid(f"{name}[{bad}] = {ids[bad]} is out of range for vocab size {vocab_size}")
    return ids

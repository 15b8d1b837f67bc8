"""Hidden-state quantization for the wire (DESIGN 4.3): symmetric per-row int8
(scale = absmax / 127) and float8 e4m3fn (scale = absmax / 448), one float32 scale a row.

`quantize_rows` / `dequantize_rows` dispatch (triton_support.use_kernel): one Triton
program per row on CUDA, the torch reference elsewhere. The kernels reproduce the
reference bit for bit: IEEE division (div_rn), round-half-even, and the fp8 code built
from the float32 bits with integer ops (no fp8 conversion instruction, so sm_80 works).
A zero row gets scale 0 and decodes to zeros; a row holding NaN or Inf gets a non-finite
scale, which every decoder rejects (codec: INVALID_ARGUMENT).
"""

from __future__ import annotations

import torch

from chainspec.kernels.triton_support import launcher, triton_available, use_kernel

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_RNE_MAGIC = 12582912.0  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 half-to-even


def quantize_rows(x: torch.Tensor, qdtype: torch.dtype = torch.int8
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] float -> (q [T, H] int8 | float8_e4m3fn, scale [T] float32)."""
    if qdtype not in QMAX:
        raise ValueError(f"quantize_rows: qdtype must be int8 or float8_e4m3fn, got {qdtype}")
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be [T, H], got {list(x.shape)}")
    if use_kernel(x) and x.numel():
        return _quantize_triton(x, qdtype)
    return quantize_rows_reference(x, qdtype)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [T, H] int8 | float8_e4m3fn, scale [T] float32 -> [T, H] `dtype` (q * scale)."""
    if q.dtype not in QMAX or q.dim() != 2 or scale.shape != q.shape[:1]:
        raise ValueError(f"dequantize_rows: need q [T, H] int8/fp8 and scale [T], got "
                         f"{q.dtype} {list(q.shape)} and {list(scale.shape)}")
    if use_kernel(q) and q.numel():
        return _dequantize_triton(q, scale, dtype)
    return dequantize_rows_reference(q, scale, dtype)


def quantize_rows_reference(x: torch.Tensor, qdtype: torch.dtype = torch.int8
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path and test oracle of `quantize_rows`."""
    x = x.float()  # [T, H]
    qmax = QMAX[qdtype]
    absmax = x.abs().amax(dim=1) if x.numel() else x.new_zeros(x.shape[0])  # [T]
    # [T]; 0 for an all-zero row, which then decodes to 0. NOTE: a tensor divisor: torch
    # on CUDA divides by a Python scalar as a multiply by its reciprocal (not IEEE)
    scale = absmax / torch.full_like(absmax, qmax)
    # NOTE: divide, not multiply by qmax / absmax: that overflows for subnormal rows.
    y = (x / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-qmax, qmax)  # [T, H]
    if qdtype == torch.int8:
        return y.round_().to(torch.int8), scale
    return y.to(torch.float8_e4m3fn), scale


def dequantize_rows_reference(q: torch.Tensor, scale: torch.Tensor,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The torch path and test oracle of `dequantize_rows`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def _block(h: int) -> int:
    return min(4096, max(16, 1 << (h - 1).bit_length()))


def _quantize_triton(x: torch.Tensor, qdtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, h = x.shape
    fp8 = qdtype == torch.float8_e4m3fn
    codes = torch.empty(t, h, dtype=torch.uint8 if fp8 else torch.int8, device=x.device)
    scale = torch.empty(t, dtype=torch.float32, device=x.device)
    launcher(_quantize_kernel, x)[(t,)](x, codes, scale, h, x.stride(0), QMAX=QMAX[qdtype],
                                        FP8=fp8, BLOCK=_block(h))
    return (codes.view(torch.float8_e4m3fn) if fp8 else codes), scale


def _dequantize_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                       ) -> torch.Tensor:
    q = q if q.stride(-1) == 1 else q.contiguous()
    t, h = q.shape
    fp8 = q.dtype == torch.float8_e4m3fn
    codes = q.view(torch.uint8) if fp8 else q
    out = torch.empty(t, h, dtype=dtype, device=q.device)
    launcher(_dequantize_kernel, q)[(t,)](codes, scale.float().contiguous(), out, h,
                                          q.stride(0), FP8=fp8, BLOCK=_block(h))
    return out


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, H, stride_x, QMAX: tl.constexpr,
                         FP8: tl.constexpr, BLOCK: tl.constexpr):
        """One row: absmax pass, then codes. q_ptr is int8 (FP8 False) or uint8 e4m3 bits."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * H
        absmax = tl.zeros([BLOCK], tl.float32)
        bad = tl.zeros([BLOCK], tl.int32)  # NaN/Inf seen
        for h0 in range(0, H, BLOCK):
            cols = h0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < H, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(x))
            bad += ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
        scale = tl.math.div_rn(tl.max(absmax, 0), QMAX)
        # NOTE: a non-finite row must get a non-finite scale (decoders reject it), and
        # tl.max does not propagate NaN the way torch's amax does.
        scale = tl.where(tl.sum(bad, 0) > 0, float("nan"), scale)
        tl.store(scale_ptr + row, scale)
        div = tl.where(scale > 0, scale, 1.0)
        for h0 in range(0, H, BLOCK):
            cols = h0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < H, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(tl.math.div_rn(x, div), -QMAX), QMAX)  # [BLOCK]
            if FP8:
                # e4m3fn code of y (|y| <= 448) with round-half-even, from its fp32 bits
                bits = y.to(tl.int32, bitcast=True)
                a = tl.abs(y)
                e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 a)
                sub = e < -6  # e4m3 subnormal (or zero): steps of 2**-9
                shift = tl.where(sub, 9, 3 - e)  # a * 2**shift: [0, 8) or [8, 16)
                s = a * ((shift + 127) << 23).to(tl.float32, bitcast=True)
                r = ((s + 12582912.0) - 12582912.0).to(tl.int32)  # _RNE_MAGIC
                # r == 16 carries into the exponent by the addition itself
                code = tl.where(sub, r, ((e + 7) << 3) + (r - 8))
                code = code | ((bits >> 24) & 0x80)  # sign bit, -0.0 included
                tl.store(q_row + cols, code.to(tl.uint8), mask=cols < H)
            else:
                r = (y + 12582912.0) - 12582912.0  # _RNE_MAGIC: torch.round semantics
                tl.store(q_row + cols, r.to(tl.int8), mask=cols < H)

    @triton.jit
    def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, H, stride_q, FP8: tl.constexpr,
                           BLOCK: tl.constexpr):
        """One row: out = value(q) * scale, cast to out's dtype."""
        row = tl.program_id(0).to(tl.int64)
        scale = tl.load(scale_ptr + row)
        for h0 in range(0, H, BLOCK):
            cols = h0 + tl.arange(0, BLOCK)
            q = tl.load(q_ptr + row * stride_q + cols, mask=cols < H, other=0)
            if FP8:
                b = q.to(tl.int32) & 0xFF
                e = (b >> 3) & 0xF
                m = (b & 7).to(tl.float32)
                pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)  # 2**(e - 10)
                v = tl.where(e == 0, m * 0.001953125, (m + 8.0) * pow2)  # 2**-9 subnormal
                v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
                v = tl.where((b & 0x80) != 0, -v, v)
            else:
                v = q.to(tl.float32)
            out = (v * scale).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * H + cols, out, mask=cols < H)

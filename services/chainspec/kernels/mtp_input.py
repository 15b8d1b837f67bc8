"""MTP input fusion: u = concat(enorm(emb), hnorm(hidden)) (or hidden first) in one pass.

`fused_mtp_input` dispatches (triton_support.use_kernel): one Triton program per row on
CUDA, reading each input row once and writing both halves of u; the torch reference
(RMSNorm exactly as models/layers.py computes it) elsewhere and whenever autograd needs
the graph (training) or the weights' dtype differs from the inputs'.
"""

from __future__ import annotations

import torch

from chainspec.kernels.triton_support import launcher, triton_available, use_kernel


def fused_mtp_input(emb: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                    w_h: torch.Tensor, eps: float, unit_offset: bool,
                    hidden_first: bool) -> torch.Tensor:
    """emb, hidden [T, H]; w_e, w_h [H] -> u [T, 2H]: [enorm(emb), hnorm(hidden)], or
    [hnorm(hidden), enorm(emb)] with `hidden_first`."""
    if _kernel_fits(emb, hidden, w_e, w_h):
        return _fused_triton(emb, hidden, w_e, w_h, eps, unit_offset, hidden_first)
    return fused_mtp_input_reference(emb, hidden, w_e, w_h, eps, unit_offset, hidden_first)


def fused_mtp_input_reference(emb: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                              w_h: torch.Tensor, eps: float, unit_offset: bool,
                              hidden_first: bool) -> torch.Tensor:
    """The torch path and test oracle of `fused_mtp_input`."""
    e, g = rms_norm(emb, w_e, eps, unit_offset), rms_norm(hidden, w_h, eps, unit_offset)
    return torch.cat([g, e] if hidden_first else [e, g], dim=-1)  # [T, 2H]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
             ) -> torch.Tensor:
    """RMSNorm as layers.RMSNorm.forward: statistics in fp32; the plain form rounds the
    normalized row to x's dtype before scaling by the weight, the unit-offset form after."""
    dtype = x.dtype
    x32 = x if dtype == torch.float32 else x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (weight.float() + 1.0)).to(dtype)
    return weight * (x32 if dtype == torch.float32 else x32.to(dtype))


def _kernel_fits(emb: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                 w_h: torch.Tensor) -> bool:
    if not use_kernel(emb) or emb.dim() != 2 or emb.shape != hidden.shape or not emb.numel():
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (emb, hidden, w_e, w_h)):
        return False  # NOTE: the kernel has no backward; training takes the torch path
    dtypes = {emb.dtype, hidden.dtype, w_e.dtype, w_h.dtype}
    return len(dtypes) == 1 and emb.dtype in (torch.float32, torch.float16, torch.bfloat16)


def _fused_triton(emb: torch.Tensor, hidden: torch.Tensor, w_e: torch.Tensor,
                  w_h: torch.Tensor, eps: float, unit_offset: bool,
                  hidden_first: bool) -> torch.Tensor:
    emb = emb if emb.stride(-1) == 1 else emb.contiguous()
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    t, h = emb.shape
    u = torch.empty(t, 2 * h, dtype=emb.dtype, device=emb.device)  # [T, 2H]
    block = max(16, 1 << (h - 1).bit_length())
    launcher(_mtp_input_kernel, emb)[(t,)](
        emb, hidden, w_e.contiguous(), w_h.contiguous(), u, h, emb.stride(0),
        hidden.stride(0), float(eps), UNIT_OFFSET=unit_offset, HIDDEN_FIRST=hidden_first,
        IS_FP32=emb.dtype == torch.float32, BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return u


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _mtp_input_kernel(emb_ptr, hid_ptr, we_ptr, wh_ptr, u_ptr, H, stride_e, stride_h,
                          eps, UNIT_OFFSET: tl.constexpr, HIDDEN_FIRST: tl.constexpr,
                          IS_FP32: tl.constexpr, BLOCK: tl.constexpr):
        """One row: both RMSNorms (fp32 statistics) written into the two halves of u."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        u_row = u_ptr + row * 2 * H
        # NOTE: two inline copies of one norm, not a @jit helper: kernels_on_cpu() can
        # interpret only self-contained kernels (triton_support)
        x = tl.load(emb_ptr + row * stride_e + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(we_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = x * tl.rsqrt(tl.sum(x * x, 0) / H + eps)
        if UNIT_OFFSET:
            y = x * (w + 1.0)
        elif IS_FP32:
            y = w * x
        else:
            y = w * x.to(u_ptr.dtype.element_ty).to(tl.float32)  # rounded, then scaled
        off = H if HIDDEN_FIRST else 0
        tl.store(u_row + off + cols, y.to(u_ptr.dtype.element_ty), mask=mask)

        x = tl.load(hid_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(wh_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = x * tl.rsqrt(tl.sum(x * x, 0) / H + eps)
        if UNIT_OFFSET:
            y = x * (w + 1.0)
        elif IS_FP32:
            y = w * x
        else:
            y = w * x.to(u_ptr.dtype.element_ty).to(tl.float32)
        off = 0 if HIDDEN_FIRST else H
        tl.store(u_row + off + cols, y.to(u_ptr.dtype.element_ty), mask=mask)

"""Gated DeltaNet over packed rows with a state per row (DESIGN 4.9, 5): the CUDA path of
`models/gated_deltanet.py`, whose row form is the oracle.

Two kernels, each reading only device tensors (`StateRows.seq_starts`, `slot_ids`,
`src_rows`, `keep_flags`), so a step that calls them can be captured in a CUDA graph:
- `conv1d_rows`: the depthwise causal conv1d + SiLU, one program per (sequence, channel
  block), rows in order, the last K-1 inputs in registers;
- `delta_rule_rows`: the gated delta rule in its fused recurrent form, one program per
  (sequence, value head, block of value channels) with the state `[Dk, BLOCK_V]` in
  registers, rows in order (l2norm of q and k and q's scale inside).
Each sequence starts from its pool's kept row `src` (-1: zeros) and stores the state
after every row at pool row r when it keeps every row (a verify window of K+1 rows),
else the final state only, at row 0; padding sequences (slot -1) read and write nothing
and their rows, like rows outside every span, come out zero. Spans are contiguous and in
order: sequence i owns rows seq_starts[i] .. seq_starts[i+1]-1.

NOTE: a program reads its part of the initial state before it writes any row, and no
other program touches that part, so `src` may be one of the rows this step overwrites
(a verify window after a verify window: src = j, rows 0..K rewritten).
NOTE: long prefill spans take the recurrent form too: correct, but O(rows) sequential
per program where the CPU path's chunked form (`delta_rule_chunked`) uses matmuls.
flash-linear-attention's chunked kernel would serve them; it returns the final state
only, which is all a prefill chunk keeps, but not the per-row states of a verify window.

NOTE: these functions have no torch fallback: the layer dispatches (kernel on CUDA
tensors, its own torch form elsewhere).
"""

from __future__ import annotations

import torch

from chainspec.kernels.triton_support import launcher, triton_available, use_kernel
from chainspec.models.recurrent import StateRows

BLOCK_C = 256  # conv channels per program
BLOCK_V = 32  # value channels per delta-rule program (state [Dk, BLOCK_V] in registers)
NUM_WARPS = 4
L2NORM_EPS = 1e-6  # models.gated_deltanet.l2norm's


def conv1d_rows(mixed: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                rows: StateRows) -> torch.Tensor:
    """mixed `[T, C]` (conv inputs), weight `[C, K]` (K = 2..4), conv_pool
    `[slots, kept_rows, C, K-1]` -> silu(causal conv) `[T, C]` fp32; writes the pool."""
    t, c = mixed.shape
    k = weight.shape[1]
    _require_kernel(mixed)
    if weight.shape[0] != c or conv_pool.shape[2:] != (c, k - 1) or not 2 <= k <= 4:
        raise ValueError(f"conv1d_rows: mixed {tuple(mixed.shape)}, weight "
                         f"{tuple(weight.shape)}, pool {tuple(conv_pool.shape)}")
    if conv_pool.stride(-1) != 1 or conv_pool.stride(-2) != k - 1:
        raise ValueError("conv1d_rows: the pool's [C, K-1] must be contiguous")
    _check_rows(rows, t)
    mixed, weight = mixed.contiguous(), weight.contiguous()
    out = torch.zeros(t, c, dtype=torch.float32, device=mixed.device)  # [T, C]
    num_seqs = rows.slot_ids.shape[0]
    if num_seqs == 0 or t == 0:
        return out
    grid = (num_seqs, triton.cdiv(c, BLOCK_C))
    launcher(_conv1d_rows_kernel, mixed)[grid](
        mixed, weight, conv_pool, out, rows.seq_starts, rows.slot_ids, rows.src_rows,
        rows.keep_flags, c, conv_pool.stride(0), conv_pool.stride(1),
        KERNEL=k, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
    return out


def delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    log_decay: torch.Tensor, beta: torch.Tensor, state_pool: torch.Tensor,
                    rows: StateRows) -> torch.Tensor:
    """q, k `[T, Hk, Dk]` (before l2norm; rows may be strided), v `[T, Hv, Dv]`,
    log_decay, beta `[T, Hv]`, state_pool `[slots, kept_rows, Hv, Dk, Dv]` -> outputs
    `[T, Hv, Dv]` fp32; writes the pool. Value head h reads key head h // (Hv / Hk);
    q is l2-normalised and scaled by Dk^-1/2, k l2-normalised, as the layer does."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    _require_kernel(q)
    if (k.shape != q.shape or v.shape[0] != t or hv % hk or log_decay.shape != (t, hv)
            or beta.shape != (t, hv) or state_pool.shape[2:] != (hv, dk, dv)):
        raise ValueError(f"delta_rule_rows: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, gates {tuple(log_decay.shape)}/"
                         f"{tuple(beta.shape)}, pool {tuple(state_pool.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v)) or not state_pool[0, 0].is_contiguous():
        raise ValueError("delta_rule_rows: head dims and the pool's [Hv, Dk, Dv] must be "
                         "contiguous")
    _check_rows(rows, t)
    log_decay, beta = log_decay.float().contiguous(), beta.float().contiguous()
    out = torch.zeros(t, hv, dv, dtype=torch.float32, device=q.device)  # [T, Hv, Dv]
    num_seqs = rows.slot_ids.shape[0]
    if num_seqs == 0 or t == 0:
        return out
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (num_seqs, hv, triton.cdiv(dv, block_v))
    launcher(_delta_rule_rows_kernel, q)[grid](
        q, k, v, log_decay, beta, state_pool, out, rows.seq_starts, rows.slot_ids,
        rows.src_rows, rows.keep_flags, dk ** -0.5, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        state_pool.stride(0), state_pool.stride(1),
        GROUP=hv // hk, HV=hv, DK=dk, DV=dv, DK_PAD=triton.next_power_of_2(dk),
        BLOCK_V=block_v, EPS=L2NORM_EPS, num_warps=NUM_WARPS)
    return out


def _require_kernel(t: torch.Tensor) -> None:
    if not use_kernel(t):
        raise RuntimeError("gated_delta kernels need CUDA tensors and triton (the layer's "
                           "torch form is the CPU path)")


def _check_rows(rows: StateRows, num_rows: int) -> None:
    s = rows.slot_ids.shape[0]
    if (rows.seq_starts.shape != (s + 1,) or rows.src_rows.shape != (s,)
            or rows.keep_flags.shape != (s,)):
        raise ValueError(f"gated_delta: StateRows tensors for {s} sequences: starts "
                         f"{tuple(rows.seq_starts.shape)}, src {tuple(rows.src_rows.shape)}, "
                         f"keep {tuple(rows.keep_flags.shape)}")
    if rows.spans and rows.spans[-1][1] > num_rows:
        raise ValueError(f"gated_delta: spans end at row {rows.spans[-1][1]} of {num_rows}")


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _conv1d_rows_kernel(
            x_ptr, w_ptr, pool_ptr, out_ptr, starts_ptr, slot_ptr, src_ptr, keep_ptr,
            C, stride_ps, stride_pr, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr):
        seq = tl.program_id(0)
        ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        live = ch < C
        slot = tl.load(slot_ptr + seq)
        if slot >= 0:
            start = tl.load(starts_ptr + seq)
            end = tl.load(starts_ptr + seq + 1)
            src = tl.load(src_ptr + seq)
            keep = tl.load(keep_ptr + seq)
            slot_base = pool_ptr + slot * stride_ps + ch * (KERNEL - 1)  # [BLOCK_C]
            # h1 the newest of the last K-1 inputs, h2, h3 older (unused ones stay 0)
            h1 = tl.zeros([BLOCK_C], tl.float32)
            h2 = tl.zeros([BLOCK_C], tl.float32)
            h3 = tl.zeros([BLOCK_C], tl.float32)
            if src >= 0:
                init = slot_base + src * stride_pr
                h1 = tl.load(init + KERNEL - 2, mask=live, other=0.0).to(tl.float32)
                if KERNEL >= 3:
                    h2 = tl.load(init + KERNEL - 3, mask=live, other=0.0).to(tl.float32)
                if KERNEL >= 4:
                    h3 = tl.load(init + KERNEL - 4, mask=live, other=0.0).to(tl.float32)
            tl.debug_barrier()  # NOTE: src may be a row this program overwrites below
            w_row = w_ptr + ch * KERNEL
            for t in range(start, end):
                x = tl.load(x_ptr + t * C + ch, mask=live,
                            other=0.0).to(tl.float32)
                acc = x * tl.load(w_row + KERNEL - 1, mask=live, other=0.0).to(tl.float32)
                acc += h1 * tl.load(w_row + KERNEL - 2, mask=live, other=0.0).to(tl.float32)
                if KERNEL >= 3:
                    acc += h2 * tl.load(w_row + KERNEL - 3, mask=live,
                                        other=0.0).to(tl.float32)
                if KERNEL >= 4:
                    acc += h3 * tl.load(w_row + KERNEL - 4, mask=live,
                                        other=0.0).to(tl.float32)
                tl.store(out_ptr + t * C + ch, acc / (1.0 + tl.exp(-acc)),
                         mask=live)
                h3 = h2
                h2 = h1
                h1 = x
                if (keep != 0) | (t == end - 1):
                    kept = slot_base + tl.where(keep != 0, t - start, 0) * stride_pr
                    dtype = pool_ptr.dtype.element_ty
                    tl.store(kept + KERNEL - 2, h1.to(dtype), mask=live)
                    if KERNEL >= 3:
                        tl.store(kept + KERNEL - 3, h2.to(dtype), mask=live)
                    if KERNEL >= 4:
                        tl.store(kept + KERNEL - 4, h3.to(dtype), mask=live)

    @triton.jit
    def _delta_rule_rows_kernel(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, out_ptr, starts_ptr, slot_ptr,
            src_ptr, keep_ptr, scale, stride_qt, stride_qh, stride_kt, stride_kh,
            stride_vt, stride_vh, stride_ps, stride_pr, GROUP: tl.constexpr,
            HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_PAD: tl.constexpr,
            BLOCK_V: tl.constexpr, EPS: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        dk = tl.arange(0, DK_PAD)  # [DK_PAD]
        k_in = dk < DK
        v_in = dv < DV
        s_in = k_in[:, None] & v_in[None, :]
        slot = tl.load(slot_ptr + seq)
        if slot >= 0:
            start = tl.load(starts_ptr + seq)
            end = tl.load(starts_ptr + seq + 1)
            src = tl.load(src_ptr + seq)
            keep = tl.load(keep_ptr + seq)
            # [DK_PAD, BLOCK_V] offsets of this program's part of S [Hv, Dk, Dv]
            s_off = head * DK * DV + dk[:, None] * DV + dv[None, :]
            slot_base = pool_ptr + slot * stride_ps + s_off
            state = tl.zeros([DK_PAD, BLOCK_V], tl.float32)
            if src >= 0:
                state = tl.load(slot_base + src * stride_pr, mask=s_in,
                                other=0.0).to(tl.float32)
            tl.debug_barrier()  # NOTE: src may be a row this program overwrites below
            kh = head // GROUP
            for t in range(start, end):
                row = t  # int64: the bounds are
                q = tl.load(q_ptr + row * stride_qt + kh * stride_qh + dk, mask=k_in,
                            other=0.0).to(tl.float32)
                k = tl.load(k_ptr + row * stride_kt + kh * stride_kh + dk, mask=k_in,
                            other=0.0).to(tl.float32)
                q = q * tl.rsqrt(tl.sum(q * q, 0) + EPS) * scale
                k = k * tl.rsqrt(tl.sum(k * k, 0) + EPS)
                v = tl.load(v_ptr + row * stride_vt + head * stride_vh + dv, mask=v_in,
                            other=0.0).to(tl.float32)
                g = tl.load(g_ptr + row * HV + head)
                b = tl.load(beta_ptr + row * HV + head)
                state = state * tl.exp(g)
                delta = (v - tl.sum(state * k[:, None], 0)) * b  # [BLOCK_V]
                state = state + k[:, None] * delta[None, :]
                o = tl.sum(state * q[:, None], 0)  # [BLOCK_V]
                tl.store(out_ptr + (row * HV + head) * DV + dv, o, mask=v_in)
                if keep != 0:
                    tl.store(slot_base + (t - start) * stride_pr,
                             state.to(pool_ptr.dtype.element_ty), mask=s_in)
            if (keep == 0) & (end > start):
                tl.store(slot_base, state.to(pool_ptr.dtype.element_ty), mask=s_in)

"""Fused MoE experts: every row's top-k SwiGLU experts, weighted and summed, in two grouped
GEMMs (the design of vLLM's `fused_moe`: sort by expert, pad to the block, one launch).

    out[t] = sum_j w[t, j] * down[e](silu(gate[e] x[t]) * up[e] x[t]),  e = ids[t, j]

`fused_moe` dispatches (triton_support.use_kernel): on CUDA, `align_block_size` sorts the
T*k (row, slot) pairs by expert and pads each expert's run to a multiple of BLOCK_M, so a
program's BLOCK_M rows all use one expert; `_moe_gemm_kernel` then runs gate/up with SiLU
fused (-> act [T*k, I]) and down with the routing weight fused (-> [T*k, H]), and the k
slots are summed per row. Elsewhere the torch reference (a loop over the experts hit) is the
path and the oracle. Neither syncs with the host on the kernel path: buffers are sized by a
static bound, and programs past the padded total return at once.

Weights (transformers 5.x layout, models/moe.py): gate_up [E, 2I, H] (rows: gate then up),
down [E, H, I]; x [T, H] in the weights' dtype; ids [T, k] int; weights [T, k] fp32.
A negative id is a pair with no expert here (expert parallel: the expert is another
rank's): it is never computed and adds nothing to its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chainspec.kernels.triton_support import (
    interpreted_bf16_dot,
    launcher,
    triton_available,
    use_kernel,
)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], ids/weights [T, k] -> [T, H] (x.dtype).
    `limit`: the clamped SwiGLU min(silu(g), limit) * clamp(u, -limit, limit) (Step-3.5)."""
    if use_kernel(x) and not _needs_grad(x, gate_up, down, weights):
        return _fused_triton(x, gate_up, down, ids, weights, limit)
    return fused_moe_reference(x, gate_up, down, ids, weights, limit)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Training keeps the autograd path (the reference); the kernel has no backward."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def fused_moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        ids: torch.Tensor, weights: torch.Tensor, limit: float | None = None
                        ) -> torch.Tensor:
    """The torch path and test oracle: per expert hit, its rows through SwiGLU, scaled by
    their routing weights and added into an fp32 sum (cast to x's dtype at the end); pairs
    with a negative id are skipped. NOTE: `.tolist()` syncs; this is the CPU path, CUDA
    takes the kernel."""
    rows, top_k = ids.shape
    flat = ids.reshape(-1).clamp(min=-1)  # [T*k]; -1: no expert here
    order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert, -1 first
    none, *counts = torch.bincount(flat + 1, minlength=gate_up.shape[0] + 1).tolist()
    out = torch.zeros(rows, x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
    start = none
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]  # [n] flat (row * k + slot)
        start += n
        token = pairs // top_k
        g, u = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)  # [n, I] each
        g = F.silu(g)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        y = F.linear(g * u, down[e])  # [n, H]
        out.index_add_(0, token, y.float() * weights.reshape(-1)[pairs, None].float())
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------
# Sorting by expert (torch ops on the device; no host sync).


@dataclass(frozen=True)
class ExpertBlocks:
    """The (row, slot) pairs sorted by expert, each expert's run padded to `block_m`."""

    sorted_pairs: torch.Tensor  # [P] int32 flat pair (row * k + slot); padding = T*k
    block_expert: torch.Tensor  # [P // block_m] int32 expert of each block
    total: torch.Tensor  # [1] int32 padded length actually used (<= P)
    block_m: int


def padded_bound(pairs: int, num_experts: int, block_m: int) -> int:
    """A static bound on the padded length: at most min(E, pairs) experts are hit and each
    pads by < block_m; rounded up to whole blocks."""
    bound = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the T*k (row, slot) pairs of `ids` [T, k] by expert (stable: row order within
    an expert) and pad each expert's run to a multiple of `block_m`. Pairs with a negative
    id (no expert here) are left out: no block holds them."""
    flat = ids.reshape(-1).to(torch.int64)  # [T*k]
    pairs = flat.numel()
    flat = torch.where(flat < 0, num_experts, flat)  # no expert here: bucket E, dropped
    # NOTE: not bincount, which reads the max id on the host (a sync; no graph capture)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E + 1]
    padded = (counts + block_m - 1) // block_m * block_m  # [E + 1]
    start = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted index of each expert
    padded_end = torch.cumsum(padded, 0)[:num_experts]  # [E]
    padded_start = torch.cat([padded_end[:1] * 0, padded_end])  # [E + 1]
    order = torch.argsort(flat, stable=True)  # [T*k]
    expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - start[expert]
    bound = padded_bound(pairs, num_experts, block_m)
    # one slot past the bound takes every dropped pair (bucket E), then is cut off
    slot = torch.where(expert < num_experts, padded_start[expert] + rank, bound)
    sorted_pairs = torch.full((bound + 1,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[slot] = order.to(torch.int32)
    sorted_pairs = sorted_pairs[:bound]
    block_first = torch.arange(0, bound, block_m, device=ids.device)  # [P // block_m]
    block_expert = torch.searchsorted(padded_end, block_first, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)  # past total
    return ExpertBlocks(sorted_pairs, block_expert, padded_end[-1:].to(torch.int32), block_m)


# ---------------------------------------------------------------------------------------
# The Triton path.


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def pick_tiles(rows: int, top_k: int, num_experts: int, dtype: torch.dtype) -> Tiles:
    """Decode/verify (few pairs per expert): 16-row blocks waste least padding; prefill
    chunks: 64-row blocks reuse each weight tile across more rows. fp32: smaller K tiles."""
    if dtype == torch.float32:  # ieee dots run on FMA units: 64-row tiles need ~255 regs
        return Tiles(16, 64, 32, num_warps=4, num_stages=3)
    per_expert = rows * top_k / num_experts
    return Tiles(16 if per_expert <= 16 else 64, 64, 64, num_warps=4, num_stages=3)


def _fused_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  ids: torch.Tensor, weights: torch.Tensor, limit: float | None = None
                  ) -> torch.Tensor:
    rows, top_k = ids.shape
    num_experts, two_i, hidden = gate_up.shape
    inter = two_i // 2
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    tiles = pick_tiles(rows, top_k, num_experts, x.dtype)
    blocks = align_block_size(ids, num_experts, tiles.block_m)
    pairs = rows * top_k
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # [T*k, I]
    # zeros: pairs with no expert here are never stored
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)  # [T*k, H]
    w = weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    _launch(x, gate_up, act, w, blocks, inter, hidden, top_k, tiles, gated=True, limit=limit)
    _launch(act, down, out, w, blocks, hidden, inter, 1, tiles, gated=False)
    return out.view(rows, top_k, hidden).sum(1).to(x.dtype)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, w: torch.Tensor,
            blocks: ExpertBlocks, n: int, k: int, a_div: int, tiles: Tiles, gated: bool,
            limit: float | None = None) -> None:
    """c[pair, :n] = gated ? silu(a Bg^T) * (a Bu^T) : w[pair] * (a B^T), B = b[expert]."""
    import triton

    grid = (blocks.sorted_pairs.numel() // tiles.block_m, triton.cdiv(n, tiles.block_n))
    dot_fp32 = a.dtype == torch.float32 or (a.dtype == torch.bfloat16 and interpreted_bf16_dot())
    launcher(_moe_gemm_kernel, a)[grid](
        a, b, c, w, blocks.sorted_pairs, blocks.block_expert, blocks.total,
        n, k, w.numel(), a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        0.0 if limit is None else float(limit),
        A_DIV=a_div, GATED=gated, CLAMP=limit is not None, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_FP32=dot_fp32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, pairs_ptr, block_expert_ptr, total_ptr,
                         N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm, limit,
                         A_DIV: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr,
                         BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_FP32: tl.constexpr):
        """One BLOCK_M x BLOCK_N tile of one expert's padded run. A's row of a pair is
        pair // A_DIV (x rows for gate/up, A_DIV = k; act rows for down, A_DIV = 1)."""
        pid_m = tl.program_id(0)
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return  # past the padded total (the grid is a static bound)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
        live = pair < num_pairs  # padding rows read zeros and store nothing
        a_row = (pair // A_DIV).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        col_ok = cols < N
        b_base = b_ptr + expert * stride_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + a_row[:, None] * stride_am + ks[None, :],
                        mask=live[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            b_mask = k_ok[:, None] & col_ok[None, :]
            b = tl.load(b_base + cols[None, :] * stride_bn + ks[:, None], mask=b_mask,
                        other=0.0)  # [BK, BN]: rows `cols` of B, transposed
            acc = _dot(a, b, acc, DOT_FP32)
            if GATED:
                b_up = tl.load(b_base + (cols + N)[None, :] * stride_bn + ks[:, None],
                               mask=b_mask, other=0.0)
                acc_up = _dot(a, b_up, acc_up, DOT_FP32)
        if GATED:
            acc = acc * tl.sigmoid(acc)  # silu(gate) * up, in fp32
            if CLAMP:  # the clamped SwiGLU (Step-3.5)
                acc = tl.minimum(acc, limit)
                acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = acc * acc_up
        else:
            acc = acc * tl.load(w_ptr + pair, mask=live, other=0.0)[:, None]
        c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])

    @triton.jit
    def _dot(a, b, acc, DOT_FP32: tl.constexpr):
        if DOT_FP32:  # fp32 inputs: exact (ieee), not tf32; bf16 under the interpreter
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

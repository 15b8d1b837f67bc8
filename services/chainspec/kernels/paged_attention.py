"""Paged attention over packed rows of many sequences (prefill chunks, verify windows and
decode rows mixed), reading keys/values through block tables.

Cache layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`. Row t of
sequence s = row_seq[t] attends to s's cached positions 0..positions[t] (this step's keys
were stored first). Padding rows (row_seq -1) return zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chainspec.kernels.triton_support import use_kernel


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention of packed query rows against a paged cache.

    q `[T, Hq, D]`; k_cache, v_cache `[blocks, block_size, Hkv, D]` (Hq = G * Hkv);
    block_tables `[S, max_blocks]` int32; row_seq `[T]` (-1 = padding row);
    positions `[T]` int64. Returns `[T, Hq, D]` in q's dtype. The Triton kernel on CUDA
    tensors, the torch reference elsewhere.
    """
    _check(q, k_cache, v_cache, block_tables, row_seq, positions)
    if use_kernel(q) and False:  # the Triton kernel lands in the next commit
        pass
    return paged_attention_reference(q, k_cache, v_cache, block_tables, row_seq, positions,
                                     scale)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, row_seq: torch.Tensor,
                              positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch reference (the CPU path and the test oracle): per sequence, gather its blocks
    up to its largest position and run SDPA (fp32) with a causal-by-position mask over its
    rows only, so the cost follows each sequence's own length. NOTE: syncs once (row
    grouping to the host); CPU path only."""
    out = torch.zeros_like(q)  # [T, Hq, D]
    for seq, rows in _rows_by_sequence(row_seq):
        pos = positions[rows]  # [n]
        length = int(pos.max()) + 1
        keys = _gather(k_cache, block_tables[seq], length)  # [L, Hkv, D]
        values = _gather(v_cache, block_tables[seq], length)
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [n, L]
        o = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), keys.float().transpose(0, 1),
            values.float().transpose(0, 1), attn_mask=mask, scale=scale,
            enable_gqa=True)  # [Hq, n, D]
        out[rows] = o.transpose(0, 1).to(q.dtype)
    return out


def _rows_by_sequence(row_seq: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(sequence, its packed row indices) for every sequence with rows, one host sync."""
    valid = (row_seq >= 0).nonzero().squeeze(1)  # [n]
    seqs = row_seq[valid]
    order = torch.argsort(seqs, stable=True)
    ids, counts = torch.unique_consecutive(seqs[order], return_counts=True)
    return list(zip(ids.tolist(), valid[order].split(counts.tolist()), strict=True))


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached positions `[length, Hkv, D]`."""
    block_size = cache.shape[1]
    blocks = table[: (length + block_size - 1) // block_size].long()
    return cache[blocks].flatten(0, 1)[:length]


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, caches {tuple(k_cache.shape)}"
                         f"/{tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"paged_attention: q heads/dim {tuple(q.shape[1:])} do not fit "
                         f"the cache's {tuple(k_cache.shape[2:])}")
    if row_seq.shape != q.shape[:1] or positions.shape != q.shape[:1]:
        raise ValueError(f"paged_attention: row_seq {tuple(row_seq.shape)}, positions "
                         f"{tuple(positions.shape)} for {q.shape[0]} rows")
    if block_tables.dim() != 2:
        raise ValueError(f"paged_attention: block_tables {tuple(block_tables.shape)}")

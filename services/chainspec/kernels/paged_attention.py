"""Paged attention over packed rows of many sequences (prefill chunks, verify windows and
decode rows mixed), reading keys/values through block tables.

Cache layout per layer: keys `[num_blocks, block_size, num_kv_heads, head_dim]`, values
`[..., v_head_dim]` (their own tensor, or a strided view of the keys' leading channels: a
latent cache). Row t of sequence s = row_seq[t] attends to s's cached positions
0..positions[t] (this step's keys were stored first), or with a sliding `window` W to
positions[t]-W+1..positions[t]; table entries below every row's window (blocks given
back) are never read. `sinks` [Hq]: a logit per head joining the softmax denominator.
Padding rows (row_seq -1) return zeros.
"""

from __future__ import annotations

import torch

from chainspec.kernels.paged_reference import (
    ReferencePlan,
    paged_attention_reference,
    reference_plan,
)
from chainspec.kernels.triton_support import (
    interpreted_bf16_dot,
    launcher,
    triton_available,
    use_kernel,
)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                    scale: float, plan: ReferencePlan | None = None, *,
                    window: int | None = None, sinks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Attention of packed query rows against a paged cache.

    q `[T, Hq, Dk]`; k_cache `[blocks, block_size, Hkv, Dk]`, v_cache
    `[blocks, block_size, Hkv, Dv]` (Hq = G * Hkv; may be a view of k_cache's first Dv
    channels); block_tables `[S, max_blocks]` int32; row_seq `[T]` (-1 = padding row);
    positions `[T]` int64; `window` W: row p sees keys p-W+1..p; `sinks` `[Hq]`.
    Returns `[T, Hq, Dv]` in q's dtype. The Triton kernel on CUDA tensors, the torch
    reference elsewhere (`plan`: from `attention_plan`, made once per step for every
    layer whatever its window; None: made here).
    """
    _check(q, k_cache, v_cache, block_tables, row_seq, positions, window, sinks)
    if use_kernel(q):
        return _paged_attention_triton(q, k_cache, v_cache, block_tables, row_seq, positions,
                                       scale, window, sinks)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, row_seq, positions,
                                     scale, plan, window=window, sinks=sinks)


def attention_plan(block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                   block_size: int) -> ReferencePlan | None:
    """The reference's per-step plan, or None where the kernel runs (it needs none, and a
    plan would sync)."""
    if use_kernel(positions):
        return None
    return reference_plan(block_tables, row_seq, positions, block_size)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
           window: int | None, sinks: torch.Tensor | None) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
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
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window {window} must be >= 1")
    if sinks is not None and sinks.shape != q.shape[1:2]:
        raise ValueError(f"paged_attention: sinks {tuple(sinks.shape)} for {q.shape[1]} "
                         f"query heads")


# ---------------------------------------------------------------------------------------
# Triton kernel: one program per (tile of one sequence's rows x kv head). The tile's M
# dimension packs BLOCK_Q rows x the G query heads of one kv head (GQA), so tl.dot has
# M >= 16 even for decode rows; keys come TILE_N positions at a time through the block
# table, up to the largest position in the tile; online softmax, fp32 accumulators.

TILE_N = 32  # key positions per inner step (any block_size: a tile spans or splits blocks)
NUM_STAGES = 2  # the AOT test compiles with it


def _plan(row_seq: torch.Tensor, num_seqs: int, block_q: int) -> tuple[torch.Tensor, ...]:
    """Host-side prep, vectorised on the rows' device (no sync, graph-capturable): group
    rows by sequence and give each program its (sequence, first row within it).

    Returns order [T] (packed rows, sequence-major), seq_start [S], seq_count [S],
    tile_seq [P], tile_first [P] with P = ceil(T / block_q) + min(S, T), an upper bound on
    the tiles; programs past the real tiles get tile_first >= seq_count and exit.
    """
    t = row_seq.shape[0]
    key = torch.where(row_seq >= 0, row_seq.long(), num_seqs)  # [T], padding last
    order = torch.argsort(key, stable=True).to(torch.int32)  # [T]
    count = torch.zeros(num_seqs + 1, dtype=torch.int64, device=row_seq.device)
    count = count.scatter_add_(0, key, torch.ones_like(key))[:num_seqs]  # [S]
    start = count.cumsum(0) - count  # [S]
    tiles = (count + block_q - 1) // block_q  # [S]
    tiles_end = tiles.cumsum(0)  # [S]
    programs = torch.arange((t + block_q - 1) // block_q + min(num_seqs, t),
                            device=row_seq.device)  # [P]
    tile_seq = torch.searchsorted(tiles_end, programs, right=True).clamp_(max=num_seqs - 1)
    tile_first = (programs - (tiles_end - tiles)[tile_seq]) * block_q  # [P]
    return (order, start.to(torch.int32), count.to(torch.int32), tile_seq.to(torch.int32),
            tile_first.to(torch.int32))


def _tiling(num_rows: int, group: int, dtype: torch.dtype, width: int) -> tuple[int, int]:
    """(BLOCK_M rows x heads per tile, num_warps). 16-row tiles for decode/verify-sized
    batches, 64 when the batch is large (prefill chunks), never below the GQA group;
    shape-based, so no sync. NOTE: fp32 (ieee dots, no tensor cores) keeps 16-row tiles and
    8 warps: anything bigger spills registers (see test_aot_compile); so do 16-bit tiles
    whose padded head width (`width`, keys or values) reaches 512 (a latent cache)."""
    if dtype == torch.float32:
        return max(16, triton.next_power_of_2(group)), 8
    if width >= 512:
        return max(16, triton.next_power_of_2(group)), 8
    m = 64 if num_rows >= 256 else 16
    return max(m, triton.next_power_of_2(group)), 4


def _padded(dim: int) -> int:
    """A head width as a tile dimension: a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(dim))


def _paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, row_seq: torch.Tensor,
                            positions: torch.Tensor, scale: float, window: int | None,
                            sinks: torch.Tensor | None) -> torch.Tensor:
    t, hq, dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    v_dim = v_cache.shape[-1]
    group = hq // hkv
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: the head dimension must be contiguous")
    out = torch.zeros(t, hq, v_dim, dtype=q.dtype, device=q.device)  # padding rows stay 0
    if t == 0 or block_tables.shape[0] == 0:
        return out
    block_m, num_warps = _tiling(t, group, q.dtype, max(_padded(dim), _padded(v_dim)))
    order, start, count, tile_seq, tile_first = _plan(row_seq, block_tables.shape[0],
                                                      block_m // group)
    grid = (tile_seq.shape[0], hkv)
    sinks = q if sinks is None else sinks.float().contiguous()  # q: an unread placeholder
    launcher(_paged_attention_kernel, q)[grid](
        q, k_cache, v_cache, out, block_tables, positions, order, start, count, tile_seq,
        tile_first, sinks, scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=dim, V_DIM=v_dim, DK_PAD=_padded(dim), DV_PAD=_padded(v_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_N=TILE_N,
        DOT_FP32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16
                                              and interpreted_bf16_dot()),
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not q,
        num_warps=num_warps, num_stages=NUM_STAGES)
    return out


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_attention_kernel(
            q_ptr, kc_ptr, vc_ptr, out_ptr, tables_ptr, pos_ptr, order_ptr, start_ptr,
            count_ptr, tile_seq_ptr, tile_first_ptr, sinks_ptr, scale_log2, window,
            stride_qt, stride_qh, stride_ot, stride_oh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
            DK_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, DOT_FP32: tl.constexpr,
            HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_first_ptr + tile)
        count = tl.load(count_ptr + seq)
        if first < count:
            m = tl.arange(0, BLOCK_M)
            qi = first + m // GROUP  # [M] row index within the sequence
            head = kv_head * GROUP + m % GROUP  # [M] query head
            live = qi < count
            row = tl.load(order_ptr + tl.load(start_ptr + seq) + qi, mask=live, other=0)
            row = row.to(tl.int64)
            pos = tl.load(pos_ptr + row, mask=live, other=-1)  # [M]
            dk = tl.arange(0, DK_PAD)
            dv = tl.arange(0, DV_PAD)
            k_in = dk < HEAD_DIM
            v_in = dv < V_DIM
            q_off = row[:, None] * stride_qt + head[:, None] * stride_qh + dk[None, :]
            q = tl.load(q_ptr + q_off, mask=live[:, None] & k_in[None, :],
                        other=0.0)  # [M, Dk]
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
            max_pos = tl.max(pos, 0)
            lowest = 0  # the lowest key position any row of the tile sees
            if HAS_WINDOW:
                min_pos = tl.min(tl.where(live, pos, max_pos), 0)
                lowest = tl.maximum(min_pos - window + 1, 0)
            table = tables_ptr + seq.to(tl.int64) * stride_bt
            for j in range(lowest // TILE_N, max_pos // TILE_N + 1):
                kpos = j * TILE_N + tl.arange(0, TILE_N)  # [N]
                # NOTE: keys below `lowest` (blocks given back) are never loaded
                kin = (kpos <= max_pos) & (kpos >= lowest)
                blk = tl.load(table + kpos // BLOCK_SIZE, mask=kin, other=0).to(tl.int64)
                off = kpos % BLOCK_SIZE
                k_off = blk * stride_kb + off * stride_ks + kv_head * stride_kh  # [N]
                v_off = blk * stride_vb + off * stride_vs + kv_head * stride_vh
                k = tl.load(kc_ptr + k_off[:, None] + dk[None, :],
                            mask=kin[:, None] & k_in[None, :], other=0.0)  # [N, Dk]
                v = tl.load(vc_ptr + v_off[:, None] + dv[None, :],
                            mask=kin[:, None] & v_in[None, :], other=0.0)  # [N, Dv]
                if DOT_FP32:  # fp32 inputs: exact (ieee), not tf32
                    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)),
                               input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k.to(q.dtype)))
                s = s * scale_log2
                seen = kpos[None, :] <= pos[:, None]  # [M, N]
                if HAS_WINDOW:
                    seen = seen & (kpos[None, :] > pos[:, None] - window)
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # NOTE: rows with no key yet (dead rows) keep m = -inf; shift by 0 there.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                if DOT_FP32:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            if HAS_SINKS:  # one more logit in the denominator, no value
                sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # [M], log2 units
                m_fin = tl.maximum(m_i, sink)
                alpha = tl.exp2(m_i - m_fin)
                l_i = l_i * alpha + tl.exp2(sink - m_fin)
                acc = acc * alpha[:, None]
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_off = row[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
            tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty),
                     mask=live[:, None] & v_in[None, :])

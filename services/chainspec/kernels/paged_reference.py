"""Torch reference of paged attention (the CPU path and the kernel's test oracle).

Sequences of similar length are batched (`_length_groups`); each batch gathers its
blocks up to its longest sequence and attends in fp32 with a causal-by-position mask, so
the cost follows each sequence's own length (a long sequence does not make short ones
read its keys). Past SDPA_MAX_KEYS keys only the columns that some row may not see
(a verify window's own last keys) are masked. The host work (grouping, gather indices,
masks, row spans) depends only on the step's batch description, so a `ReferencePlan` is
made once per step and reused by every layer. NOTE: making a plan syncs (CPU path only).

The plan is window-independent (one per block-table group; the drafter keeps windowed
layers in the full-length group): a layer's sliding window and attention sinks are
applied in its own call (`_attend_window`). There, table entries below every row's window
(blocks given back, which may point at block 0) and past a sequence's own blocks are
redirected to its first visible block and masked, so nothing stale reaches the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SDPA_MAX_KEYS = 512  # attention over at most this many keys goes through SDPA


@dataclass(frozen=True)
class _Group:
    """One batch of sequences: R query rows each (padding rows sit at position 0)."""

    blocks: torch.Tensor  # [G, nb] int64: block ids to gather (own blocks, else block 0)
    length: int  # L: keys gathered per sequence (the longest's)
    rows: int  # R
    hidden: torch.Tensor | None  # [G, R, L] bool: keys a row may not see (None: sees all)
    seen: int  # keys 0..seen-1 are seen by every row (only later ones need the mask)
    tail: torch.Tensor | None  # [G, 1, 1, R, L - seen] bool: `hidden` past `seen`
    span: tuple[int, int] | None  # packed rows [a, b) in group order, no padding
    put: tuple[torch.Tensor, torch.Tensor] | None  # (packed rows, group rows) if not span
    row_pos: torch.Tensor  # [G, R] int64: each row's position (padding rows: 0)
    first_pos: tuple[int, ...]  # per sequence: its lowest row position
    own: tuple[int, ...]  # per sequence: blocks it owns (entries past them are not its)


@dataclass(frozen=True)
class ReferencePlan:
    groups: tuple[_Group, ...]
    tiles: bool  # the groups' spans, in this order, are rows 0..T-1 (no scatter, no zeros)


def reference_plan(block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                   block_size: int) -> ReferencePlan:
    """Everything but the tensors' contents, for one step's rows."""
    seqs, pos = row_seq.tolist(), positions.tolist()
    by_seq: dict[int, list[int]] = {}
    for t, s in enumerate(seqs):
        if s >= 0:
            by_seq.setdefault(s, []).append(t)
    length = {s: max(pos[t] for t in rows) + 1 for s, rows in by_seq.items()}
    groups = [_group(block_tables, [by_seq[s] for s in group], pos,
                     [length[s] for s in group], group, block_size)
              for group in _length_groups(sorted(by_seq, key=length.get), length)]
    spans = [g.span for g in groups]
    if None not in spans:
        groups.sort(key=lambda g: g.span[0])
    tiles = bool(groups) and None not in spans and sum(b - a for a, b in spans) == len(seqs)
    return ReferencePlan(tuple(groups), tiles)


def _group(block_tables: torch.Tensor, rows: list[list[int]], pos: list[int],
           lengths: list[int], seqs: list[int], block_size: int) -> _Group:
    """One batch's plan: `rows[j]` are sequence `seqs[j]`'s packed rows."""
    r, device = max(len(x) for x in rows), block_tables.device
    src = [t for x in rows for t in x]  # packed rows, group order
    dst = [j * r + i for j, x in enumerate(rows) for i in range(len(x))]
    p_g = [0] * (len(rows) * r)  # padding rows see key 0 only
    for i, t in zip(dst, src, strict=True):
        p_g[i] = pos[t]
    hidden = None if min(p_g) + 1 >= max(lengths) else torch.arange(
        max(lengths), device=device) > torch.tensor(p_g, device=device).view(len(rows), r, 1)
    dense = src == list(range(src[0], src[0] + len(src))) and len(src) == len(p_g)
    span = (src[0], src[0] + len(src)) if dense else None
    put = None if dense else (torch.tensor(src, device=device),
                              torch.tensor(dst, device=device))
    blocks = _blocks(block_tables[seqs], lengths, block_size)
    seen = min(p_g) + 1
    tail = None if hidden is None else hidden[:, None, None, :, seen:]
    row_pos = torch.tensor(p_g, device=device).view(len(rows), r)
    first = tuple(min(pos[t] for t in x) for x in rows)
    own = tuple((n + block_size - 1) // block_size for n in lengths)
    return _Group(blocks, max(lengths), r, hidden, seen, tail, span, put, row_pos, first, own)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, row_seq: torch.Tensor,
                              positions: torch.Tensor, scale: float,
                              plan: ReferencePlan | None = None, *,
                              window: int | None = None, sinks: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """`paged_attention` in torch; `plan` (default: made here) from `reference_plan`.
    Returns `[T, Hq, Dv]` (Dv = v_cache's last dim)."""
    plan = plan or reference_plan(block_tables, row_seq, positions, k_cache.shape[1])
    outs = [_group_attention(q, k_cache, v_cache, g, scale, window, sinks)
            for g in plan.groups]
    if plan.tiles:  # the groups' spans in row order: no scatter, no zeros
        return (outs[0] if len(outs) == 1 else torch.cat(outs)).to(q.dtype)
    out = q.new_zeros(*q.shape[:2], v_cache.shape[-1])  # [T, Hq, Dv]
    for g, o in zip(plan.groups, outs, strict=True):
        if g.span:
            out[g.span[0]:g.span[1]] = o
        else:
            out[g.put[0]] = o[g.put[1]].to(q.dtype)
    return out


def _group_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _Group,
                     scale: float, window: int | None, sinks: torch.Tensor | None
                     ) -> torch.Tensor:
    """One group's rows `[G * R, Hq, Dv]` (fp32; group order, padding rows included)."""
    n = g.blocks.shape[0]
    q_g = q[g.span[0]:g.span[1]] if g.span else _scatter(q, g.put, n * g.rows)
    q_g = q_g.view(n, g.rows, *q.shape[1:])  # [G, R, Hq, D]
    if window is not None or sinks is not None:
        return _attend_window(q_g, k_cache, v_cache, g, scale, window, sinks).flatten(0, 1)
    if g.length > SDPA_MAX_KEYS:
        return _attend_long(q_g, k_cache, v_cache, g, scale).flatten(0, 1)
    keys, values = (_gather(c, g) for c in (k_cache, v_cache))  # [G, L, Hkv, D]
    return _attend_short(q_g, keys, values, g.hidden, scale).flatten(0, 1)


def _scatter(q: torch.Tensor, put: tuple[torch.Tensor, torch.Tensor], size: int
             ) -> torch.Tensor:
    """The group's query rows `[size, Hq, D]`, zeros where a sequence has fewer rows."""
    q_g = q.new_zeros(size, *q.shape[1:])
    q_g[put[1]] = q[put[0]]
    return q_g


def _length_groups(order: list[int], length: dict[int, int]) -> list[list[int]]:
    """Split sequences (sorted by length) into batches whose padding stays small: a new
    batch starts when a length passes twice the batch's shortest plus 256."""
    groups: list[list[int]] = []
    for s in order:
        if groups and length[s] <= 2 * length[groups[-1][0]] + 256:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _blocks(tables: torch.Tensor, lengths: list[int], block_size: int) -> torch.Tensor:
    """Block ids `[S, nb]` covering the longest length. NOTE: table entries past a
    sequence's own blocks are never read (they may be garbage): its padding positions
    read its first block again, and are masked off."""
    nb = (max(lengths) + block_size - 1) // block_size
    blocks = tables[:, :nb].long()  # [S, nb]
    own = [(n + block_size - 1) // block_size for n in lengths]
    if min(own) < nb:
        owned = torch.arange(nb, device=blocks.device) < torch.tensor(
            own, device=blocks.device)[:, None]  # [S, nb]
        blocks = torch.where(owned, blocks, blocks[:, :1])
    return blocks


def _gather(cache: torch.Tensor, g: _Group, blocks: torch.Tensor | None = None,
            length: int | None = None) -> torch.Tensor:
    """`[S, L, Hkv, D]`: the positions of each sequence's blocks (`blocks`, `length`:
    another selection of them, default the group's)."""
    blocks = g.blocks if blocks is None else blocks
    rows = cache.index_select(0, blocks.flatten())  # [S * nb, block_size, Hkv, D]
    return rows.view(blocks.shape[0], -1, *cache.shape[2:])[:, :length or g.length]


def _attend_short(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  hidden: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [S, R, Hq, D] over keys/values [S, L, Hkv, D] in fp32 -> [S, R, Hq, D], through
    SDPA (its fixed cost is the smaller one up to SDPA_MAX_KEYS keys)."""
    mask = None if hidden is None else ~hidden[:, None]  # [S, 1, R, L]
    o = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), keys.float().transpose(1, 2),
        values.float().transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)  # [S, R, Hq, D]


def _attend_long(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _Group,
                 scale: float) -> torch.Tensor:
    """q [S, R, Hq, D] over the group's keys in fp32 -> [S, R, Hq, D], as two batched
    matmuls with GQA groups folded into rows (no repeated keys); only the columns past
    `g.seen` are masked (every row sees the earlier ones). NOTE: not CPU SDPA: with a mask
    and few rows (decode, verify) it costs several times more here and varies with L."""
    s, r, hq, d = q.shape
    hkv = k_cache.shape[2]
    gqa = hq // hkv  # query head h reads kv head h // gqa
    qg = (q.float() * scale).view(s, r, hkv, gqa, d).permute(0, 2, 3, 1, 4).reshape(
        s, hkv, gqa * r, d)  # [S, Hkv, gqa * R, D]
    keys = _gather(k_cache, g).float().permute(0, 2, 3, 1)  # [S, Hkv, D, L]
    scores = torch.matmul(qg, keys)  # [S, Hkv, gqa * R, L]
    if g.tail is not None:
        # NOTE: fill, not add: masked keys may be stale blocks, never let them reach the sum
        scores.view(s, hkv, gqa, r, -1)[..., g.seen:].masked_fill_(g.tail, float("-inf"))
    probs = scores.softmax(-1)
    values = _gather(v_cache, g).float().transpose(1, 2)  # [S, Hkv, L, Dv]
    return _heads_back(torch.matmul(probs, values), gqa, r)  # [S, R, Hq, Dv]


def _heads_back(o: torch.Tensor, gqa: int, r: int) -> torch.Tensor:
    """[S, Hkv, gqa * R, Dv] (GQA groups folded into rows) -> [S, R, Hq, Dv]."""
    s, hkv, _, dv = o.shape
    return o.view(s, hkv, gqa, r, dv).permute(0, 3, 1, 2, 4).reshape(s, r, hkv * gqa, dv)


def _window_blocks(g: _Group, window: int | None, block_size: int
                   ) -> tuple[torch.Tensor, int]:
    """(block ids `[S, nb']`, first key position) of the keys some row of the group may
    see under `window`. A sequence's entries below its first visible block (given back:
    they may point at block 0) or past its own blocks read that first visible block
    again, masked; so nothing stale or foreign is ever gathered."""
    lo = [0 if window is None else max(0, p - window + 1) // block_size for p in g.first_pos]
    start = min(lo)
    blocks = g.blocks[:, start:]  # [S, nb']
    if max(lo) > start or min(g.own) < g.blocks.shape[1]:
        dev = blocks.device
        col = torch.arange(blocks.shape[1], device=dev)[None, :] + start  # [1, nb']
        first = torch.tensor(lo, device=dev)[:, None]  # [S, 1]
        mine = (col >= first) & (col < torch.tensor(g.own, device=dev)[:, None])
        blocks = torch.where(mine, blocks, g.blocks.gather(1, first))
    return blocks, start * block_size


def _attend_window(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: _Group,
                   scale: float, window: int | None, sinks: torch.Tensor | None
                   ) -> torch.Tensor:
    """q [S, R, Hq, D] over the keys the group's rows may see -> [S, R, Hq, Dv] in fp32:
    row p sees keys p-window+1..p; `sinks` [Hq] joins each head's softmax denominator."""
    s, r, hq, d = q.shape
    hkv = k_cache.shape[2]
    gqa = hq // hkv
    blocks, first = _window_blocks(g, window, k_cache.shape[1])
    length = g.length - first
    qg = (q.float() * scale).view(s, r, hkv, gqa, d).permute(0, 2, 3, 1, 4).reshape(
        s, hkv, gqa * r, d)  # [S, Hkv, gqa * R, D]
    keys = _gather(k_cache, g, blocks, length).float().permute(0, 2, 3, 1)  # [S, Hkv, D, L]
    scores = torch.matmul(qg, keys).view(s, hkv, gqa, r, length)  # [S, Hkv, gqa, R, L]
    kpos = torch.arange(first, g.length, device=q.device)  # [L]
    row = g.row_pos[:, None, None, :, None]  # [S, 1, 1, R, 1]
    hidden = kpos > row if window is None else (kpos > row) | (kpos <= row - window)
    # NOTE: fill, not add: masked keys may be stale blocks, never let them reach the sum
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # a sink is one more logit in the denominator that adds no value
        sink = sinks.float().view(1, hkv, gqa, 1, 1)
        top = torch.maximum(scores.amax(-1, keepdim=True), sink)  # [S, Hkv, gqa, R, 1]
        e = (scores - top).exp()
        probs = e / (e.sum(-1, keepdim=True) + (sink - top).exp())
    values = _gather(v_cache, g, blocks, length).float().transpose(1, 2)  # [S, Hkv, L, Dv]
    o = torch.matmul(probs.view(s, hkv, gqa * r, length), values)  # [S, Hkv, gqa * R, Dv]
    return _heads_back(o, gqa, r)

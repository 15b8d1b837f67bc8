"""Torch reference of paged attention (the CPU path and the kernel's test oracle).

Sequences of similar length are batched (`_length_groups`); each batch gathers its
blocks up to its longest sequence and attends in fp32 with a causal-by-position mask, so
the cost follows each sequence's own length (a long sequence does not make short ones
read its keys). The host work (grouping, gather indices, masks) depends only on the
step's batch description, so a `ReferencePlan` is made once per step and reused by
every layer. NOTE: making a plan syncs (CPU path only).
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
    put: tuple[torch.Tensor, torch.Tensor] | None  # (packed rows, group rows); None: all


@dataclass(frozen=True)
class ReferencePlan:
    groups: tuple[_Group, ...]


def reference_plan(block_tables: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor,
                   block_size: int) -> ReferencePlan:
    """Everything but the tensors' contents, for one step's rows."""
    seqs, pos = row_seq.tolist(), positions.tolist()
    by_seq: dict[int, list[int]] = {}
    for t, s in enumerate(seqs):
        if s >= 0:
            by_seq.setdefault(s, []).append(t)
    length = {s: max(pos[t] for t in rows) + 1 for s, rows in by_seq.items()}
    groups = []
    for group in _length_groups(sorted(by_seq, key=length.get), length):
        r = max(len(by_seq[s]) for s in group)
        src = [t for s in group for t in by_seq[s]]  # packed rows, group order
        dst = [j * r + i for j, s in enumerate(group) for i in range(len(by_seq[s]))]
        p_g = [0] * (len(group) * r)  # padding rows see key 0 only
        for i, t in zip(dst, src, strict=True):
            p_g[i] = pos[t]
        lengths = [length[s] for s in group]
        device = positions.device
        hidden = None if min(p_g) + 1 >= max(lengths) else torch.arange(
            max(lengths), device=device) > torch.tensor(p_g, device=device).view(
            len(group), r, 1)
        whole = src == dst and len(src) == len(seqs) == len(group) * r  # no padding
        put = None if whole else (torch.tensor(src, device=device),
                                  torch.tensor(dst, device=device))
        groups.append(_Group(_blocks(block_tables[group], lengths, block_size),
                             max(lengths), r, hidden, put))
    return ReferencePlan(tuple(groups))


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, row_seq: torch.Tensor,
                              positions: torch.Tensor, scale: float,
                              plan: ReferencePlan | None = None) -> torch.Tensor:
    """`paged_attention` in torch; `plan` (default: made here) from `reference_plan`."""
    plan = plan or reference_plan(block_tables, row_seq, positions, k_cache.shape[1])
    out = None  # [T, Hq, D], made when a group does not cover every row
    for g in plan.groups:
        n = g.blocks.shape[0]
        keys, values = (_gather(c, g.blocks, g.length) for c in (k_cache, v_cache))
        q_g = q if g.put is None else _scatter(q, g.put, n * g.rows)
        o = _attend(q_g.view(n, g.rows, *q.shape[1:]), keys, values, g.hidden, scale)
        if g.put is None:  # the group is every row, in order
            return o.flatten(0, 1).to(q.dtype)
        out = torch.zeros_like(q) if out is None else out
        out[g.put[0]] = o.flatten(0, 1)[g.put[1]].to(q.dtype)
    return torch.zeros_like(q) if out is None else out


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


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """`[S, length, Hkv, D]`: the positions of each sequence's blocks."""
    rows = cache.index_select(0, blocks.flatten())  # [S * nb, block_size, Hkv, D]
    return rows.view(blocks.shape[0], -1, *cache.shape[2:])[:, :length]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            hidden: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [S, R, Hq, D] over keys/values [S, L, Hkv, D] in fp32, GQA groups folded into
    rows (no repeated keys) -> [S, R, Hq, D]. NOTE: past SDPA_MAX_KEYS keys, plain
    matmuls, not CPU SDPA: with a mask and few rows (decode, verify) SDPA's CPU path
    costs several times more there and varies with L."""
    s, r, hq, d = q.shape
    if keys.shape[1] <= SDPA_MAX_KEYS:  # short: SDPA's fixed cost is the smaller one
        mask = None if hidden is None else ~hidden[:, None]  # [S, 1, R, L]
        o = F.scaled_dot_product_attention(
            q.float().transpose(1, 2), keys.float().transpose(1, 2),
            values.float().transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2)  # [S, R, Hq, D]
    hkv = keys.shape[2]
    g = hq // hkv  # query head h reads kv head h // g
    qg = q.float().view(s, r, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(s, hkv, g * r, d)
    scores = torch.matmul(qg, keys.float().permute(0, 2, 3, 1)) * scale  # [S, Hkv, G*R, L]
    if hidden is not None:
        # NOTE: fill, not add: masked keys may be stale blocks, never let them reach the sum
        scores.masked_fill_(hidden.repeat(1, g, 1).unsqueeze(1), float("-inf"))
    o = torch.matmul(scores.softmax(-1), values.float().transpose(1, 2))  # [S, Hkv, G*R, D]
    return o.view(s, hkv, g, r, d).permute(0, 3, 1, 2, 4).reshape(s, r, hq, d)

"""The per-round description of a drafter batch: windows packed into rows.

A *window* is one sequence's rows for this round (DESIGN 3.2): up to K-1 history rows
recomputed from committed inputs, then the rows the update brought. Row p carries the
pair (h_p, x[p+1]); the window's token stream is x[w0+1 .. N'] followed by this round's
drafts, so module k reads token stream[r + k - 1] at window row r.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chainspec.models.attention import AttnBatch


@dataclass(frozen=True)
class Window:
    blocks: tuple[int, ...]  # the sequence's block table (covers the window's rows)
    first_pos: int  # w0: position of the window's first row
    hidden: torch.Tensor  # [R, H]: h[w0 .. w0+R-1]
    tokens: torch.Tensor  # [R] int64: x[w0+1 .. w0+R]
    temperature: float = 0.0  # 0 = greedy drafts
    seed: int = 0  # keys the noise of sampled drafts (NoiseStream.SAMPLE)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True)
class DraftBatch:
    """Tensors one draft round reads. `tokens` also receives the drafts (in place)."""

    attn: AttnBatch
    hidden: torch.Tensor  # [T, H]
    tokens: torch.Tensor  # [S * W] int64: each sequence's token stream, stride W
    row_tok: torch.Tensor  # [T] int64: index of x[p+1] in `tokens` for each row
    last_row: torch.Tensor  # [S] int64: packed index of each sequence's last row
    last_tok: torch.Tensor  # [S] int64: index of x[N'] in `tokens`
    temperature: torch.Tensor  # [S] float32, 0 = greedy
    seed: torch.Tensor  # [S] int64
    any_sampled: bool = True  # False: every draft is greedy, no noise to draw


@dataclass(frozen=True)
class PackedIndex:
    """Host-side index arrays of a packing, shared by the compact and the static layout."""

    positions: list[int]
    slot_mapping: list[int]
    row_seq: list[int]
    block_tables: list[list[int]]
    row_tok: list[int]
    last_row: list[int]
    last_tok: list[int]


def pack_index(windows: Sequence[Window], num_steps: int, block_size: int,
               stride: int | None = None, num_seqs: int | None = None,
               width: int | None = None) -> PackedIndex:
    """Index arrays for `windows`. With `stride`, sequence s owns rows [s*stride, (s+1)*stride)
    and there are `num_seqs` sequences (padding rows get slot -1 and row_seq -1, padding
    sequences an all-zero block table); without, rows are packed back to back. `width`:
    block table columns (default: the widest window's)."""
    num_seqs = num_seqs if stride else len(windows)
    tok_stride = (stride or max(w.num_rows for w in windows)) + num_steps
    width = width or max(len(w.blocks) for w in windows)
    idx = PackedIndex([], [], [], [], [], [], [])
    for s in range(num_seqs):
        w = windows[s] if s < len(windows) else None
        real = w.num_rows if w else 0
        base = len(idx.positions)
        blocks = list(w.blocks) if w else []
        idx.block_tables.append(blocks + [0] * (width - len(blocks)))
        for r in range(stride or real):
            ok = r < real
            pos = w.first_pos + r if ok else 0
            idx.positions.append(pos)
            idx.slot_mapping.append(blocks[pos // block_size] * block_size + pos % block_size
                                    if ok else -1)
            idx.row_seq.append(s if ok else -1)
            idx.row_tok.append(s * tok_stride + (r if ok else 0))
        idx.last_row.append(base + max(real - 1, 0))
        idx.last_tok.append(s * tok_stride + max(real - 1, 0))
    return idx


def table_width(max_len: int, block_size: int) -> int:
    """Block table columns that hold `max_len` positions."""
    return math.ceil(max_len / block_size)


def token_stream(windows: Sequence[Window], stride: int, num_seqs: int) -> torch.Tensor:
    """[num_seqs * stride] int64: each window's tokens at the start of its stride."""
    out = torch.zeros(num_seqs, stride, dtype=torch.int64)
    for s, w in enumerate(windows):
        out[s, : w.num_rows] = w.tokens
    return out.view(-1)


def build_compact(windows: Sequence[Window], num_steps: int, block_size: int,
                  device: torch.device | str, dtype: torch.dtype) -> DraftBatch:
    """A fresh, tightly packed batch for the eager path (prefill, resync, big windows)."""
    idx = pack_index(windows, num_steps, block_size)
    tok_stride = max(w.num_rows for w in windows) + num_steps

    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    attn = AttnBatch(t(idx.positions), t(idx.slot_mapping), t(idx.row_seq),
                     torch.tensor(idx.block_tables, dtype=torch.int32, device=device))
    return DraftBatch(
        attn=attn,
        hidden=torch.cat([w.hidden for w in windows]).to(device=device, dtype=dtype),
        tokens=token_stream(windows, tok_stride, len(windows)).to(device),
        row_tok=t(idx.row_tok), last_row=t(idx.last_row), last_tok=t(idx.last_tok),
        temperature=torch.tensor([w.temperature for w in windows], device=device),
        seed=t([w.seed for w in windows]),
        any_sampled=any_sampled(windows))


def any_sampled(windows: Sequence[Window]) -> bool:
    return any(w.temperature > 0 for w in windows)

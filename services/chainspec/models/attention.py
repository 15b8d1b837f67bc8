"""Attention over packed rows: the per-step batch description and two backends.

Layers call `backend.attend(layer, q, k, v)` with q/k/v of packed rows `[T, heads, D]`.
- `PagedAttention` writes this step's keys/values into a `PagedKVCache` through each
  sequence's block table and lets each row attend to its sequence's cached positions
  <= its own (prefill chunks, verify windows and decode rows mix freely; padding rows
  have slot -1 and row_seq -1: they write nowhere and read nothing).
- `DenseCausal` is plain causal attention over a `[B, T]` batch, for training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chainspec.kernels.kv_store import store_kv
from chainspec.kernels.paged_attention import attention_plan, paged_attention
from chainspec.models.kv_cache import PagedKVCache


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows in a packed batch: positions start .. start+num_rows-1, stored
    through `block_table` (block ids covering at least start + num_rows positions)."""

    block_table: Sequence[int]
    start: int
    num_rows: int


@dataclass(frozen=True)
class AttnBatch:
    """Per-step description of packed rows. Immutable; tensors have fixed roles."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset, -1 = padding row
    row_seq: torch.Tensor  # [T] int64: the row's sequence (index into block_tables), -1 pad
    block_tables: torch.Tensor  # [S, max_blocks] int32

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, seqs: Sequence[SeqRows], block_size: int,
              device: torch.device | str = "cpu", width: int | None = None) -> AttnBatch:
        """Pack sequences in order. Host-side; one transfer per tensor. `width`: block
        table columns (default: the most any sequence here uses)."""
        positions, slots, row_seq = [], [], []
        for i, s in enumerate(seqs):
            for p in range(s.start, s.start + s.num_rows):
                positions.append(p)
                slots.append(s.block_table[p // block_size] * block_size + p % block_size)
                row_seq.append(i)
        width = width or max((len(s.block_table) for s in seqs), default=1)
        tables = [list(s.block_table) + [0] * (width - len(s.block_table)) for s in seqs]

        def t(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)
        return cls(t(positions), t(slots), t(row_seq),
                   torch.tensor(tables, dtype=torch.int32, device=device).view(len(seqs), width))


class PagedAttention:
    """Attention against a paged KV cache for one step's `AttnBatch`."""

    def __init__(self, cache: PagedKVCache, batch: AttnBatch, scale: float) -> None:
        self.cache = cache
        self.batch = batch
        self.scale = scale
        # the CPU reference's grouping and masks, once for every layer (None on the kernel)
        self.plan = attention_plan(batch.block_tables, batch.row_seq, batch.positions,
                                   cache.block_size)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        b, keys, values = self.batch, self.cache.keys[layer], self.cache.values[layer]
        store_kv(k, v, keys, values, b.slot_mapping)
        return paged_attention(q, keys, values, b.block_tables, b.row_seq, b.positions,
                               self.scale, self.plan)  # [T, Hq, D]


class DenseCausal:
    """Causal self-attention over a dense `[batch, seq_len]` block (training, references)."""

    def __init__(self, batch_size: int, seq_len: int, scale: float) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.scale = scale

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        del layer
        shape = (self.batch_size, self.seq_len)
        q4, k4, v4 = (x.view(*shape, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=self.scale,
                                             enable_gqa=True)  # [B, H, T, D]
        return out.transpose(1, 2).reshape(-1, *q.shape[1:])

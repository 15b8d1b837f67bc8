"""Attention over packed rows: the per-step batch description and two backends.

Layers call `backend.attend(layer, q, k, v)` with q/k/v of packed rows `[T, heads, D]`.
- `PagedAttention` writes this step's keys/values into a slot `KVCache` and lets each row
  attend to every cached position <= its own in its slot (prefill chunks, verify windows
  and decode rows mix freely; padding rows have slot -1 and write nowhere).
- `DenseCausal` is plain causal attention over a `[B, T]` batch, for training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chainspec.models.kv_cache import KVCache


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows in a packed batch: positions start .. start+num_rows-1."""

    slot: int
    start: int
    num_rows: int


@dataclass(frozen=True)
class AttnBatch:
    """Per-step description of packed rows. Immutable; tensors have fixed roles.

    Rows of sequence s occupy packed indices row_index[s, :n_s]; entries past n_s point to
    a padding row (index T). `kv_len` is how many cache positions attention reads per slot.
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding row
    seq_slots: torch.Tensor  # [S] int64, -1 = padding sequence
    row_index: torch.Tensor  # [S, Qmax] int64 into [0, T]
    row_seq: torch.Tensor  # [T] int64: which sequence a row belongs to
    row_offset: torch.Tensor  # [T] int64: the row's index inside its sequence
    kv_len: int

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, seqs: Sequence[SeqRows], device: torch.device | str = "cpu",
              kv_len: int | None = None) -> AttnBatch:
        """Pack sequences in order. Host-side; one transfer per tensor."""
        positions, slots, row_seq, row_offset = [], [], [], []
        qmax = max((s.num_rows for s in seqs), default=1)
        total = sum(s.num_rows for s in seqs)
        row_index = []
        for i, s in enumerate(seqs):
            base = len(positions)
            positions.extend(range(s.start, s.start + s.num_rows))
            slots.extend([s.slot] * s.num_rows)
            row_seq.extend([i] * s.num_rows)
            row_offset.extend(range(s.num_rows))
            row_index.append([base + j if j < s.num_rows else total for j in range(qmax)])
        needed = max((s.start + s.num_rows for s in seqs), default=1)
        def t(x: list) -> torch.Tensor:  # noqa: E306
            return torch.tensor(x, dtype=torch.int64, device=device)
        return cls(t(positions), t(slots), t([s.slot for s in seqs]), t(row_index),
                   t(row_seq), t(row_offset), kv_len or needed)


class PagedAttention:
    """Attention against a slot KV cache for one step's `AttnBatch`."""

    def __init__(self, cache: KVCache, batch: AttnBatch, scale: float) -> None:
        self.cache = cache
        self.batch = batch
        self.scale = scale
        padded_pos = torch.cat([batch.positions, batch.positions.new_zeros(1)])
        query_pos = padded_pos[batch.row_index]  # [S, Qmax]
        keys = torch.arange(batch.kv_len, device=batch.positions.device)
        # NOTE: a row sees cached positions <= its own; padded query entries sit at
        # position 0 and so always see one key (no all-masked row, no NaN).
        self.mask = (keys[None, None, :] <= query_pos[:, :, None])[:, None]  # [S,1,Qmax,Kmax]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        b = self.batch
        self.cache.write(layer, b.slot_mapping, b.positions, k, v)
        slots = b.seq_slots.clamp(min=0)
        keys = self.cache.keys[layer][slots, : b.kv_len].to(q.dtype)  # [S, Kmax, Hkv, D]
        values = self.cache.values[layer][slots, : b.kv_len].to(q.dtype)
        padded_q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[b.row_index]  # [S,Qmax,Hq,D]
        out = F.scaled_dot_product_attention(
            padded_q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self.mask, scale=self.scale, enable_gqa=True)  # [S, Hq, Qmax, D]
        return out.transpose(1, 2)[b.row_seq, b.row_offset]  # [T, Hq, D]


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

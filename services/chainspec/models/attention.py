"""Attention over packed rows: the per-step batch description and two backends.

Layers call `backend.attend(layer, q, k, v, ...)` with q/k/v of packed rows
`[T, heads, D]`, and linear-attention layers `backend.recurrent(layer)` for their
sequences' states (DESIGN 4.9).
- `PagedAttention` writes this step's keys/values into a `ModelKVCache` through each
  sequence's block table (one table per cache group: full length, or one window size)
  and lets each row attend to its sequence's cached positions <= its own (prefill
  chunks, verify windows and decode rows mix freely; padding rows have slot -1 and
  row_seq -1: they write nowhere and read nothing).
- `DenseCausal` is plain causal attention over a `[B, T]` batch (training, resync,
  references): every sequence starts at position 0 with a zero recurrent state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from chainspec.kernels.dense_attention import dense_attention
from chainspec.kernels.kv_store import store_kv
from chainspec.kernels.paged_attention import attention_plan, paged_attention
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.recurrent import PooledStates, RecurrentAccess, StateRows, ZeroStates


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows in a packed batch: positions start .. start+num_rows-1, stored
    through `block_table` (block ids covering at least start + num_rows positions).

    `window_tables`: per window size, the sequence's table for that group (entries of
    blocks given back are never read). `state_slot` / `state_src`: its recurrent-state
    slot and the kept row holding its committed state (-1: start from zero);
    `keep_rows`: keep the state after every row (a verify window) or only the last;
    `state_snaps`: (row, slot, kept row) where the state after a row is written too."""

    block_table: Sequence[int]
    start: int
    num_rows: int
    window_tables: Mapping[int, Sequence[int]] = field(default_factory=dict)
    state_slot: int = -1
    state_src: int = -1
    keep_rows: bool = False
    state_snaps: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class PagedGroup:
    """Where a cache group's layers store and read this step's rows."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = padding row
    block_tables: torch.Tensor  # [S, max_blocks] int32


@dataclass(frozen=True)
class AttnBatch:
    """Per-step description of packed rows. Immutable; tensors have fixed roles.
    `slot_mapping`/`block_tables` are the full-length group's; `windows` the others'."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset, -1 = padding row
    row_seq: torch.Tensor  # [T] int64: the row's sequence (index into block_tables), -1 pad
    block_tables: torch.Tensor  # [S, max_blocks] int32
    windows: Mapping[int, PagedGroup] = field(default_factory=dict)
    states: StateRows | None = None

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    def group(self, window: int | None) -> PagedGroup:
        if window is None:
            return PagedGroup(self.slot_mapping, self.block_tables)
        return self.windows[window]

    @classmethod
    def build(cls, seqs: Sequence[SeqRows], block_size: int,
              device: torch.device | str = "cpu", width: int | None = None,
              windows: Sequence[int] = (), with_states: bool = False) -> AttnBatch:
        """Pack sequences in order. Host-side; one transfer per tensor. `width`: block
        table columns (default: the most any sequence here uses). `windows`: the window
        sizes of the model's windowed groups; `with_states`: the model keeps states."""
        positions, row_seq = [], []
        for i, s in enumerate(seqs):
            positions.extend(range(s.start, s.start + s.num_rows))
            row_seq.extend([i] * s.num_rows)

        def t(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)
        main = _paged_group([s.block_table for s in seqs], seqs, block_size, device, width)
        groups = {w: _paged_group([s.window_tables[w] for s in seqs], seqs, block_size,
                                  device, width) for w in windows}
        spans, first = [], 0
        for s in seqs:
            spans.append((first, first + s.num_rows))
            first += s.num_rows
        states = StateRows.build([(s.state_slot, s.state_src, s.keep_rows) for s in seqs],
                                 spans, device, [s.state_snaps for s in seqs]
                                 ) if with_states else None
        return cls(t(positions), main.slot_mapping, t(row_seq), main.block_tables, groups,
                   states)


def _paged_group(tables: Sequence[Sequence[int]], seqs: Sequence[SeqRows], block_size: int,
                 device: torch.device | str, width: int | None) -> PagedGroup:
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, s in enumerate(seqs) for p in range(s.start, s.start + s.num_rows)]
    width = width or max((len(t) for t in tables), default=1)
    rows = [list(t) + [0] * (width - len(t)) for t in tables]
    return PagedGroup(torch.tensor(slots, dtype=torch.int64, device=device),
                      torch.tensor(rows, dtype=torch.int32, device=device).view(
                          len(tables), width))


class PagedAttention:
    """Attention against a paged KV cache for one step's `AttnBatch`."""

    def __init__(self, cache: ModelKVCache, batch: AttnBatch, scale: float | None = None
                 ) -> None:
        self.cache = cache
        self.batch = batch
        self.scale = scale  # default for layers that pass none
        self._plans: dict[int | None, object] = {}

    def _plan(self, key: int | None):
        # the CPU reference's grouping, once per block-table group for every layer
        if key not in self._plans:
            g, b = self.batch.group(key), self.batch
            self._plans[key] = attention_plan(g.block_tables, b.row_seq, b.positions,
                                              self.cache.block_size)
        return self._plans[key]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               *, scale: float | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None, value_dim: int | None = None
               ) -> torch.Tensor:
        """q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] (None: a latent layer, whose
        values are the first Dv channels of its keys) -> [T, Hq, Dv]."""
        del value_dim  # the layer's cache spec knows it
        b, entry = self.batch, self.cache.paged(layer)
        spec = entry.spec
        if spec.window != window:
            raise ValueError(f"layer {layer}: attends with window {window}, cached with "
                             f"{spec.window}")
        key = self.cache.group_key(layer)
        g = b.group(key)
        store_kv(k, v, entry.keys, entry.values, g.slot_mapping)
        return paged_attention(q, entry.keys, entry.values, g.block_tables, b.row_seq,
                               b.positions, _scale(scale, self.scale, q), self._plan(key),
                               window=window, sinks=sinks)

    def recurrent(self, layer: int) -> RecurrentAccess:
        if self.batch.states is None:
            raise ValueError("this step's batch carries no recurrent states")
        return PooledStates(self.cache.state(layer), self.batch.states)


class DenseCausal:
    """Causal self-attention over a dense `[batch, seq_len]` block (training, references)."""

    def __init__(self, batch_size: int, seq_len: int, scale: float | None = None) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.scale = scale

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               *, scale: float | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None, value_dim: int | None = None
               ) -> torch.Tensor:
        del layer
        shape = (self.batch_size, self.seq_len)
        if v is None:  # latent: values lead the keys
            v = k[..., :value_dim]
        q4, k4, v4 = (x.reshape(*shape, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        out = dense_attention(q4, k4, v4, _scale(scale, self.scale, q), window, sinks)
        return out.transpose(1, 2).reshape(-1, q.shape[1], v.shape[-1])  # [B*T, Hq, Dv]

    def recurrent(self, layer: int) -> RecurrentAccess:
        del layer
        return ZeroStates(self.batch_size, self.seq_len)


def _scale(scale: float | None, default: float | None, q: torch.Tensor) -> float:
    if scale is not None:
        return scale
    return default if default is not None else q.shape[-1] ** -0.5

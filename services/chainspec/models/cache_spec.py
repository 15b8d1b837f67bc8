"""What each layer kind keeps between steps: its cache spec (DESIGN 2.4, 4.9).

A layer declares one spec; the engine sizes and owns the tensors (`kv_cache.ModelKVCache`):
- `PagedSpec`: keys/values per position through a block table (full attention, sliding
  window, MLA's latent). `window` set: a row at position p sees keys p-window+1..p, so
  blocks wholly below the window are given back as the sequence grows. `latent`: one
  tensor per position, the values being its first `v_head_dim` channels (MLA's c_kv, with
  k_rope after it), so nothing is stored twice.
- `StateSpec`: a fixed-size recurrent state per sequence (linear attention), kept after
  every row of a verify window so that j accepted drafts continue from row j's state.

Layers with equal paged specs share block tables (a *group*): every full-length layer is
one group, every window size its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _elem(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class PagedSpec:
    num_kv_heads: int
    head_dim: int  # key width per head (MLA latent: kv_lora_rank + rope dim)
    v_head_dim: int | None = None  # value width (None: head_dim)
    window: int | None = None  # sliding window W (None: full length)
    latent: bool = False  # values are the first v_head_dim channels of the keys

    def __post_init__(self) -> None:
        if self.latent and (self.num_kv_heads != 1 or self.value_dim > self.head_dim):
            raise ValueError("a latent cache has one head whose values lead its keys")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def group_key(self) -> int | None:
        """Layers with the same key share block tables: the window (None: full length)."""
        return self.window

    def shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], ...]:
        """Tensor shapes of one layer: (keys, values), or (latent,)."""
        keys = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        if self.latent:
            return (keys,)
        return keys, (num_blocks, block_size, self.num_kv_heads, self.value_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return sum(math.prod(s) for s in self.shapes(1, block_size)) * _elem(dtype)

    def blocks_per_seq(self, block_size: int, max_rows: int) -> int | None:
        """The most blocks one sequence holds at once (None: grows with its length).
        A step writes at most `max_rows` rows, each seeing `window` keys back."""
        if self.window is None:
            return None
        return math.ceil((self.window - 1 + max_rows) / block_size) + 1


@dataclass(frozen=True)
class StateSpec:
    """Per-sequence state tensors (e.g. conv [C, kernel-1] and recurrent [H, Dk, Dv])."""

    shapes: tuple[tuple[int, ...], ...]

    def bytes_per_seq(self, rows: int, dtype: torch.dtype) -> int:
        """Bytes one sequence takes when `rows` per-row copies are kept (K+1)."""
        return rows * sum(math.prod(s) for s in self.shapes) * _elem(dtype)


CacheSpec = PagedSpec | StateSpec

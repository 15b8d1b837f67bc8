"""How a model's cache is sized: full-length KV blocks from a byte budget, a share of
free device memory, an exact count, or (none given) as many as fixed slots would have
reserved; windowed groups and recurrent states are bounded per sequence and sized for
`max_seqs` up front, their bytes taken off the budget first (DESIGN 2.4, 4.9).

One frozen `KVBudget` travels in both engines' configs; each engine turns it into a
cache once, with its own model's cache specs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chainspec.engine.block_allocator import BlockAllocator
from chainspec.engine.kv_groups import CacheClaims
from chainspec.engine.state_snapshots import StateSnapshots
from chainspec.models.cache_spec import CacheSpec, PagedSpec, StateSpec
from chainspec.models.kv_cache import ModelKVCache
from chainspec.spine.sections import StackSection
from chainspec.spine.sections import default as spine_default

DEFAULT_BLOCK_SIZE = spine_default(StackSection, "block_size")  # the spine's block_size


@dataclass(frozen=True)
class KVBudget:
    memory_bytes: int | None = None  # --kv-cache-memory: KV bytes over all layers
    fraction: float | None = None  # share of free device memory (CUDA only)
    block_size: int = DEFAULT_BLOCK_SIZE
    blocks: int | None = None  # an exact full-length block count (tests, benchmarks)
    # vLLM's gpu_memory_utilization: this process may fill this share of the device's
    # TOTAL memory, weights included; the KV pool takes what is left of it (CUDA only)
    utilization: float | None = None
    prefix_caching: bool = True  # --enable-prefix-caching (DESIGN 4.12)
    # recurrent-state snapshots at block boundaries, for hybrid models' prefix caching
    # (engine/state_snapshots.py); None: as many as the running sequences' kept rows
    state_snapshots: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.memory_bytes}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.fraction}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0, got {self.state_snapshots}")
        if self.blocks is not None and self.blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {self.blocks}")
        if self.utilization is not None and not 0 < self.utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.utilization}")
        given = [x for x in (self.memory_bytes, self.fraction, self.blocks, self.utilization)
                 if x is not None]
        if len(given) > 1:
            raise ValueError("give one of kv_cache_memory_bytes, kv_cache_fraction, "
                             "gpu_memory_utilization and blocks")

    def num_blocks(self, per_block: int, max_seqs: int, max_len: int,
                   device: torch.device, fixed_bytes: int = 0) -> int:
        """Full-length blocks that fit the budget after `fixed_bytes` (at least one)."""
        if self.blocks is not None:
            return self.blocks
        reserved = max_seqs * math.ceil(max_len / self.block_size)  # what fixed slots held
        if per_block == 0:  # no full-length layer: the table only numbers positions
            return reserved
        if self.memory_bytes is not None:
            return max(1, (self.memory_bytes - fixed_bytes) // per_block)
        if self.fraction is not None and device.type == "cuda":
            # NOTE: engines size their cache once their model is resident, so `free` is
            # net of exactly the weights this process loaded (a drafter: embedding, head,
            # MTP layers); blocks the loads left cached but unused are handed back first
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(device)
            return max(1, (int(free * self.fraction) - fixed_bytes) // per_block)
        if self.utilization is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # NOTE: as above; `total - free` is what is in use
            free, total = torch.cuda.mem_get_info(device)
            room = int(total * self.utilization) - (total - free)
            return max(1, (room - fixed_bytes) // per_block)
        return reserved


@dataclass(frozen=True)
class CacheLayout:
    """What each group of a model's cache needs, before any tensor exists."""

    full_block_bytes: int  # one full-length block over all full-length layers
    window_blocks: dict[int, int]  # window -> pool blocks for max_seqs sequences
    window_bytes: int
    state_rows: int
    state_bytes: int  # every slot's kept rows over all recurrent layers

    @classmethod
    def of(cls, specs: Sequence[CacheSpec], block_size: int, max_seqs: int, max_rows: int,
           state_rows: int, dtype: torch.dtype, separate_windows: bool) -> CacheLayout:
        paged = [s for s in specs if isinstance(s, PagedSpec)]
        windowed = [s for s in paged if s.window is not None and separate_windows]
        full = [s for s in paged if s not in windowed]
        window_blocks = {s.window: max_seqs * s.blocks_per_seq(block_size, max_rows)
                         for s in windowed}
        window_bytes = sum(window_blocks[s.window] * s.bytes_per_block(block_size, dtype)
                           for s in windowed)
        states = [s for s in specs if isinstance(s, StateSpec)]
        return cls(sum(s.bytes_per_block(block_size, dtype) for s in full), window_blocks,
                   window_bytes, state_rows,
                   max_seqs * sum(s.bytes_per_seq(state_rows, dtype) for s in states))


def model_cache(specs: Sequence[CacheSpec], budget: KVBudget, max_seqs: int, max_len: int,
                max_rows: int, state_rows: int, dtype: torch.dtype, device: torch.device,
                separate_windows: bool = True, snapshot_states: bool = False
                ) -> tuple[ModelKVCache, BlockAllocator, CacheClaims]:
    """An engine's cache sized by `budget`, the allocator of its full-length blocks and
    the pools of its per-sequence claims. `max_rows`: the most rows one sequence writes
    in a step (its window blocks' bound); `state_rows`: rows of state kept (K+1);
    `snapshot_states`: the engine snapshots recurrent states at block boundaries (the
    verifier), so a model with states can cache prefixes."""
    layout = CacheLayout.of(specs, budget.block_size, max_seqs, max_rows, state_rows, dtype,
                            separate_windows)
    has_states = layout.state_bytes > 0
    snaps = snapshot_count(budget, max_seqs, state_rows) if has_states and snapshot_states \
        else 0
    caching = budget.prefix_caching and caches_prefixes(specs, snaps > 0)
    snaps = snaps if caching else 0
    extra = -(-snaps // state_rows)  # slots after the running ones hold the snapshots
    # NOTE: cached window blocks need room beside the running sequences' bounds: as much
    # again (a hit adopts the ceil(W / block) + 1 blocks its next row sees)
    windows = {w: n * (2 if caching else 1) for w, n in layout.window_blocks.items()}
    fixed = layout.window_bytes * (2 if caching else 1) + \
        layout.state_bytes * (max_seqs + extra) // max_seqs
    blocks = budget.num_blocks(layout.full_block_bytes, max_seqs, max_len, device, fixed)
    cache = ModelKVCache(specs, {None: blocks, **windows}, budget.block_size,
                         max_seqs + extra if has_states else 0, state_rows, dtype, device,
                         separate_windows)
    snapshots = StateSnapshots(
        [t for i, s in enumerate(specs) if isinstance(s, StateSpec) for t in cache.state(i)],
        max_seqs, state_rows, snaps) if snaps else None
    claims = CacheClaims(windows, budget.block_size,
                         max_seqs if has_states else 0, snapshots, caching)
    return cache, BlockAllocator(blocks, budget.block_size, caching), claims


def snapshot_count(budget: KVBudget, max_seqs: int, state_rows: int) -> int:
    """State snapshots kept for prefix caching: the budget's, else one per kept row of
    the running sequences (the snapshots then take as many bytes as their states)."""
    return max_seqs * state_rows if budget.state_snapshots is None else budget.state_snapshots


def caches_prefixes(specs: Sequence[CacheSpec], snapshots: bool = False) -> bool:
    """Whether a cache of `specs` can share prefix blocks. Recurrent states only with
    `snapshots` (a hit needs the state at the block boundary: engine/state_snapshots.py).
    Windowed groups in their own pools cache their blocks too (engine/kv_groups.py)."""
    return snapshots or not any(isinstance(s, StateSpec) for s in specs)


def paged_cache(num_layers: int, num_kv_heads: int, head_dim: int, budget: KVBudget,
                max_seqs: int, max_len: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[ModelKVCache, BlockAllocator]:
    """A cache of uniform full-attention layers (benchmarks' shapes) and its allocator."""
    cache, allocator, _ = model_cache([PagedSpec(num_kv_heads, head_dim)] * num_layers,
                                      budget, max_seqs, max_len, 1, 1, dtype, device)
    return cache, allocator

"""How many KV blocks an engine gets: from a byte budget, a share of free device memory,
an exact count, or (none given) as many as fixed slots would have reserved.

One frozen `KVBudget` travels in both engines' configs; each engine turns it into a
block count once, with its own model's bytes per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from chainspec.engine.block_allocator import BlockAllocator
from chainspec.models.kv_cache import PagedKVCache, block_bytes

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVBudget:
    memory_bytes: int | None = None  # --kv-cache-memory: KV bytes over all layers
    fraction: float | None = None  # share of free device memory (CUDA only)
    block_size: int = DEFAULT_BLOCK_SIZE
    blocks: int | None = None  # an exact block count (tests, benchmarks)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.memory_bytes is not None and self.memory_bytes < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.memory_bytes}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.fraction}")
        if self.blocks is not None and self.blocks < 1:
            raise ValueError(f"blocks must be >= 1, got {self.blocks}")
        given = [x for x in (self.memory_bytes, self.fraction, self.blocks) if x is not None]
        if len(given) > 1:
            raise ValueError("give one of kv_cache_memory, kv_cache_fraction and blocks")

    def num_blocks(self, per_block: int, max_seqs: int, max_len: int,
                   device: torch.device) -> int:
        """Blocks that fit the budget (at least one)."""
        if self.blocks is not None:
            return self.blocks
        if self.memory_bytes is not None:
            return max(1, self.memory_bytes // per_block)
        if self.fraction is not None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return max(1, int(free * self.fraction) // per_block)
        return max_seqs * math.ceil(max_len / self.block_size)  # what fixed slots reserved


def paged_cache(num_layers: int, num_kv_heads: int, head_dim: int, budget: KVBudget,
                max_seqs: int, max_len: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[PagedKVCache, BlockAllocator]:
    """An engine's KV cache sized by `budget`, and the allocator of its blocks."""
    per_block = block_bytes(num_layers, budget.block_size, num_kv_heads, head_dim, dtype)
    blocks = budget.num_blocks(per_block, max_seqs, max_len, device)
    cache = PagedKVCache(num_layers, blocks, budget.block_size, num_kv_heads, head_dim, dtype,
                         device)
    return cache, BlockAllocator(blocks, budget.block_size)

"""Blocks of a paged KV cache: a free list, reference counts, and each sequence's block
table.

Both engines own one `BlockAllocator` over their `PagedKVCache` and one `BlockTable` per
sequence. Allocation is all-or-nothing, so a sequence that cannot grow keeps exactly the
blocks it had (the caller preempts or refuses; nothing is half-written).

With prefix caching (`caching=True`, engine/prefix_cache.py) a block may be held by
several tables at once (a shared, read-only prefix). A cached block whose last holder
lets go stays cached and idle; idle blocks count as free and are evicted least recently
used only when the free list runs dry.
"""

from __future__ import annotations

import math

from chainspec.engine.prefix_cache import PrefixCache


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks  # holders of each block
        self.cache = PrefixCache() if caching else None

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and idle cached ones."""
        return len(self._free) + (self.cache.num_idle if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        """Blocks some table holds."""
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """Used blocks over total blocks (0-1)."""
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, or None (and nothing taken) when fewer are free. Short of free
        blocks, idle cached ones are evicted, least recently used first."""
        if n > self.num_free:
            return None
        out = [self._free.pop() if self._free else self.cache.evict() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def hold(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (cached blocks a new table shares)."""
        for b in blocks:
            if self._refs[b] == 0:
                self.cache.unpark(b)  # NOTE: only cached blocks are held while unheld
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder less for each; a block nobody holds goes back to the free list, or,
        cached, stays cached as the most recently used idle block. In reverse so that a
        table's tail blocks are evicted before its head (a shared prefix outlives them)."""
        for b in reversed(blocks):
            if self._refs[b] < 1:
                raise RuntimeError(f"block {b} freed more often than held")
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if self.cache is not None and self.cache.holds(b):
                self.cache.park(b)
            else:
                self._free.append(b)


class BlockTable:
    """One sequence's blocks, in position order."""

    def __init__(self) -> None:
        self.blocks: list[int] = []

    def __len__(self) -> int:
        return len(self.blocks)

    def adopt(self, allocator: BlockAllocator, blocks: list[int]) -> None:
        """Start an empty table with shared cached blocks (a prefix hit)."""
        if self.blocks:
            raise RuntimeError("a table adopts a cached prefix only when empty")
        allocator.hold(blocks)
        self.blocks = list(blocks)

    def ensure(self, allocator: BlockAllocator, num_tokens: int) -> bool:
        """Grow to hold positions 0..num_tokens-1. False (unchanged) when the pool is short."""
        more = allocator.blocks_for(num_tokens) - len(self.blocks)
        if more <= 0:
            return True
        got = allocator.allocate(more)
        if got is None:
            return False
        self.blocks.extend(got)
        return True

    def release(self, allocator: BlockAllocator) -> None:
        allocator.free(self.blocks)
        self.blocks = []

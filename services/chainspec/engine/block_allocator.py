"""Blocks of a paged KV cache: a free list, and each sequence's block table.

Both engines own one `BlockAllocator` over their `PagedKVCache` and one `BlockTable` per
sequence. Allocation is all-or-nothing, so a sequence that cannot grow keeps exactly the
blocks it had (the caller preempts or refuses; nothing is half-written).
"""

from __future__ import annotations

import math


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Used blocks over total blocks (0-1)."""
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class BlockTable:
    """One sequence's blocks, in position order."""

    def __init__(self) -> None:
        self.blocks: list[int] = []

    def __len__(self) -> int:
        return len(self.blocks)

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

"""A sequence's claims on the cache beyond its full-length block table (DESIGN 4.9):
one block table per windowed group, whose blocks below the window go back to the pool
as the sequence grows, and a recurrent-state slot with the kept row of its committed
state.

Both are bounded per sequence, so `CacheClaims` sizes their pools for `max_seqs` running
sequences up front: a running sequence never waits for them, and admission and
preemption stay about the full-length blocks alone.

With prefix caching, a model with states also has `StateSnapshots` (the states at block
boundaries, engine/state_snapshots.py): a sequence admitted on a cached prefix starts
from the snapshot at the prefix's end. The window pools cache their full committed
blocks under the same chain hashes: a block given back below the window stays cached
(idle, evicted LRU), and a hit adopts the blocks its next row's window can see.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from chainspec.engine.block_allocator import BlockAllocator
from chainspec.engine.prefix_cache import BlockHash

if TYPE_CHECKING:  # NOTE: it reads requests, which hold claims
    from chainspec.engine.state_snapshots import StateSnapshots


class WindowTable:
    """One sequence's blocks in a windowed group, by position; None where given back."""

    def __init__(self) -> None:
        self.blocks: list[int | None] = []

    @property
    def held(self) -> int:
        return sum(b is not None for b in self.blocks)

    def ensure(self, allocator: BlockAllocator, num_tokens: int) -> None:
        more = allocator.blocks_for(num_tokens) - len(self.blocks)
        if more <= 0:
            return
        got = allocator.allocate(more)
        if got is None:  # NOTE: the pool holds every running sequence's bound
            raise RuntimeError("windowed KV pool exhausted: a sequence exceeded its bound")
        self.blocks.extend(got)

    def trim(self, allocator: BlockAllocator, first_visible: int) -> None:
        """Give back blocks wholly below position `first_visible`."""
        for i in range(min(first_visible // allocator.block_size, len(self.blocks))):
            if self.blocks[i] is not None:
                allocator.free([self.blocks[i]])
                self.blocks[i] = None

    def adopt(self, allocator: BlockAllocator, first: int, blocks: list[int]) -> None:
        """Start an empty table with cached `blocks` from block `first` on (a hit)."""
        allocator.hold(blocks)
        self.blocks = [None] * first + list(blocks)

    def table(self) -> list[int]:
        """Block ids for a block table (given-back entries read as block 0, never
        seen: they lie below every row's window)."""
        return [0 if b is None else b for b in self.blocks]

    def release(self, allocator: BlockAllocator) -> None:
        allocator.free([b for b in self.blocks if b is not None])
        self.blocks = []


class SeqClaims:
    """What one running sequence holds besides its full-length blocks."""

    def __init__(self, windows: Iterable[int]) -> None:
        self.windows = {w: WindowTable() for w in windows}
        self.state_slot = -1  # -1: none (not running, or the model keeps no state)
        self.state_row = -1  # kept row with the committed state; -1: start from zero
        # this step's snapshots (engine/state_snapshots.py): (row, slot, kept row) the
        # prefill chunk writes, and (hash, snapshot) to cache once it is committed
        self.snapshots_due: tuple[tuple[int, int, int], ...] = ()
        self.snapshots_pending: tuple[tuple[BlockHash, int], ...] = ()

    def tables(self) -> dict[int, list[int]]:
        return {w: t.table() for w, t in self.windows.items()}


class CacheClaims:
    """Pools of the windowed groups and the state slots, for `max_seqs` sequences."""

    def __init__(self, window_blocks: dict[int, int], block_size: int, state_slots: int,
                 snapshots: StateSnapshots | None = None, caching: bool = False) -> None:
        self.pools = {w: BlockAllocator(n, block_size, caching)
                      for w, n in window_blocks.items()}
        self.block_size = block_size
        self._free_slots = list(range(state_slots - 1, -1, -1))
        self.snapshots = snapshots  # states at block boundaries (prefix caching)

    def new(self) -> SeqClaims:
        return SeqClaims(self.pools)

    def claim(self, seq: SeqClaims, prefix: BlockHash | None = None) -> None:
        """At admission: a state slot (if the model keeps states), from zero, or from
        the snapshot of `prefix` (the last block of a cached prefix it starts after)."""
        if self._free_slots and seq.state_slot < 0:
            seq.state_slot = self._free_slots.pop()
        seq.state_row = -1
        if prefix is not None and self.snapshots is not None and seq.state_slot >= 0:
            self.snapshots.load(prefix, seq.state_slot)
            seq.state_row = 0

    # -- prefix caching -------------------------------------------------------------
    def _visible(self, w: int, num_blocks: int) -> range:
        """Blocks of window `w` a row at the end of `num_blocks` blocks can see."""
        return range(max(0, num_blocks * self.block_size - w + 1) // self.block_size,
                     num_blocks)

    def usable(self, hashes: list[BlockHash], num_blocks: int) -> bool:
        """Whether a hit of `num_blocks` cached full blocks can start here: the state
        snapshot at its end, and every window's visible blocks, are cached."""
        if num_blocks and self.snapshots is not None and \
                not self.snapshots.holds(hashes[num_blocks - 1]):
            return False
        return all(pool.cache is not None and
                   all(pool.cache.lookup(hashes[i]) is not None
                       for i in self._visible(w, num_blocks))
                   for w, pool in self.pools.items())

    def adopt(self, seq: SeqClaims, hashes: list[BlockHash], num_blocks: int) -> None:
        """At a hit (`usable`): each window table starts with its visible cached blocks."""
        for w, table in seq.windows.items():
            seen = self._visible(w, num_blocks)
            cache = self.pools[w].cache
            table.adopt(self.pools[w], seen.start, [cache.lookup(hashes[i]) for i in seen])

    def cache_blocks(self, seq: SeqClaims, hashes: list[BlockHash], lo: int, hi: int) -> None:
        """Cache blocks lo..hi-1 of every window table (full, committed; before `trim`)."""
        for w, table in seq.windows.items():
            cache = self.pools[w].cache
            for i in range(lo, min(hi, len(table.blocks))):
                if cache is not None and table.blocks[i] is not None:
                    cache.insert(hashes[i], table.blocks[i])

    def ensure(self, seq: SeqClaims, num_tokens: int) -> None:
        for w, table in seq.windows.items():
            table.ensure(self.pools[w], num_tokens)

    def trim(self, seq: SeqClaims, next_position: int) -> None:
        """After a commit: keep what rows from `next_position` on (the next window and
        its drafts) can still see, keys from next_position - W + 1; the rest goes back."""
        for w, table in seq.windows.items():
            table.trim(self.pools[w], max(0, next_position - w + 1))

    def release(self, seq: SeqClaims) -> None:
        for w, table in seq.windows.items():
            table.release(self.pools[w])
        if seq.state_slot >= 0:
            self._free_slots.append(seq.state_slot)
        seq.state_slot, seq.state_row = -1, -1
        for _, snap in seq.snapshots_pending:  # never written: a preempted chunk
            self.snapshots.release(snap)
        seq.snapshots_due, seq.snapshots_pending = (), ()

"""Recurrent-state snapshots at block boundaries: prefix caching for hybrid families
(Gated DeltaNet: Qwen3.5, Qwen3-Next; DESIGN 4.9, 4.12).

A cached KV prefix alone cannot start a hybrid model: its linear-attention layers also
need their state after the prefix's last row. So the verifier keeps, beside the cached
blocks, the state (every recurrent layer's conv and ssm state) at the end of full blocks,
keyed by the block's chain hash, in a bounded pool evicted least recently used. Losing a
snapshot only loses a hit. A hit is the longest chain of cached blocks whose last block
has a snapshot (`preemption.admit_blocks`); the snapshot is copied into the sequence's
state slot and prefill starts after it.

Only states of committed tokens are kept, never one that saw a rejected draft:
- a prefill chunk asks its recurrent layers for the state after each block-ending row
  (`StateRows.snaps`: the layer writes it straight into the snapshot's place);
- a verify window keeps the state after every row anyway (DESIGN 4.9); after the commit,
  the kept rows 0..accepted that end a block are copied out. Rows past `accepted` (the
  rejected drafts) are never read.

The snapshots live in the state pool's tensors, in slots after the running sequences'
(`[slots, rows_kept, *shape]`: snapshot s at slot first + s // rows, row s % rows), so
the layers write them through the same `PooledStates` and nothing else is allocated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from chainspec.engine.prefix_cache import BlockHash, chain_hashes
from chainspec.engine.request import Request
from chainspec.engine.schedule import Work, WorkKind


class StateSnapshots:
    """`count` snapshots of the state parts `parts` (each `[slots, rows, *shape]`),
    held in slots from `first_slot` on; the cached ones by hash, in LRU order.

    Counters: `saved` snapshots written, `loaded` hits read back."""

    def __init__(self, parts: Sequence[torch.Tensor], first_slot: int, rows: int,
                 count: int) -> None:
        self.parts, self.first_slot, self.rows, self.count = list(parts), first_slot, rows, count
        self._free = list(range(count - 1, -1, -1))
        self._by_hash: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first
        self.saved = self.loaded = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def place(self, snap: int) -> tuple[int, int]:
        """(slot, row) of snapshot `snap` in the state pool."""
        return self.first_slot + snap // self.rows, snap % self.rows

    def holds(self, h: BlockHash) -> bool:
        return h in self._by_hash

    def reserve(self) -> int | None:
        """A place to write a snapshot: a free one, else the least recently used cached
        one is forgotten; None when every place waits for a write in flight."""
        if self._free:
            return self._free.pop()
        if self._by_hash:
            return self._by_hash.popitem(last=False)[1]
        return None

    def insert(self, h: BlockHash, snap: int) -> None:
        """Snapshot `snap` is written: cache it under `h` (most recently used). Already
        cached (two equal prefixes at once): the place goes back."""
        if h in self._by_hash:
            self._free.append(snap)
            return
        self._by_hash[h] = snap
        self.saved += 1

    def release(self, snap: int) -> None:
        """A reserved place that will not be written after all."""
        self._free.append(snap)

    def save(self, h: BlockHash, slot: int, row: int) -> None:
        """Copy the state kept at (`slot`, `row`) as the snapshot of `h`."""
        if h in self._by_hash:
            self._by_hash.move_to_end(h)
            return
        snap = self.reserve()
        if snap is None:
            return
        self._copy((slot, row), self.place(snap))
        self.insert(h, snap)

    def load(self, h: BlockHash, slot: int) -> None:
        """Copy the snapshot of `h` into `slot`'s kept row 0 (the committed state)."""
        snap = self._by_hash[h]
        self._by_hash.move_to_end(h)
        self._copy(self.place(snap), (slot, 0))
        self.loaded += 1

    def _copy(self, src: tuple[int, int], dst: tuple[int, int]) -> None:
        for p in self.parts:
            p[dst].copy_(p[src])

    # -- the engine's side ------------------------------------------------------------
    def plan(self, work: Sequence[Work], block_size: int) -> None:
        """Before a forward: for every prefill chunk, a snapshot place for each row that
        ends a full block whose state is not cached yet (`SeqClaims.snapshots_due`)."""
        for w in work:
            claims = w.request.claims
            claims.snapshots_due, claims.snapshots_pending = (), ()
            if w.kind is not WorkKind.PREFILL:
                continue
            due, pending = [], []
            for row, h in _block_ends(w.request, w.start, w.num_rows, block_size):
                if self.holds(h):
                    self._by_hash.move_to_end(h)
                    continue
                snap = self.reserve()
                if snap is None:
                    break
                due.append((row, *self.place(snap)))
                pending.append((h, snap))
            claims.snapshots_due, claims.snapshots_pending = tuple(due), tuple(pending)

    def commit(self, item: Work, accepted: int, block_size: int) -> None:
        """After a commit: cache what the prefill chunk wrote, or copy out the kept rows
        of a verify window that end a block, committed rows only (0..accepted)."""
        req, claims = item.request, item.request.claims
        for h, snap in claims.snapshots_pending:
            self.insert(h, snap)
        claims.snapshots_due, claims.snapshots_pending = (), ()
        if item.kind is WorkKind.VERIFY:
            for row, h in _block_ends(req, item.start, accepted + 1, block_size):
                self.save(h, claims.state_slot, row)


def _block_ends(req: Request, start: int, rows: int, block_size: int
                ) -> list[tuple[int, BlockHash]]:
    """(row, chain hash of the block it ends) for rows start.. of `rows` that end a full
    block of tokens the request knows."""
    first = -(-(start + 1) // block_size)  # blocks ending at positions >= start
    last = min(start + rows, len(req.tokens)) // block_size
    if last < first:
        return []
    hashes = chain_hashes(req.tokens, block_size, req.block_hashes, last, req.hash_root)
    return [(j * block_size - 1 - start, hashes[j - 1]) for j in range(first, last + 1)]

"""Automatic prefix caching (DESIGN 4.12): full blocks addressed by a hash chain, kept
after their last user and evicted least recently used only when the pool needs them.

A block's hash covers its parent's hash and its own token ids, so the same tokens after a
different prefix are a different block. Only **full, committed** blocks are cached: their
KV is a function of committed tokens alone, nothing writes them again, so sharing them
read-only needs no copy-on-write. `BlockAllocator` owns the reference counts; this holds
the hash <-> block maps and the idle (unreferenced) cached blocks in LRU order, so both
engines run the same code:
- the verifier caches target KV under `chain_hashes` of the committed tokens;
- the drafter caches its MTP KV under `draft_key`s the verifier sends: module k's KV at
  position p reads x[p+k], so a drafter block depends on the K tokens after it as well.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes of BLAKE2b: a collision would be a wrong output, so no 64-bit
AFTER_KEPT = 8  # drafter keys remembered per cached block (`PrefixCache.note_after`)


def block_hash(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """The hash of a full block after the block hashed `parent` (None: the first)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, known: list[BlockHash],
                 num_blocks: int | None = None, root: BlockHash | None = None
                 ) -> list[BlockHash]:
    """`known` (hashes of the first blocks of `tokens`) extended, in place, to the first
    `num_blocks` full blocks (default: every full block). `root`: the first block's
    parent (`salt_root`; None: the unsalted pool)."""
    full = len(tokens) // block_size if num_blocks is None else num_blocks
    while len(known) < full:
        i = len(known)
        known.append(block_hash(known[-1] if known else root,
                                tokens[i * block_size:(i + 1) * block_size]))
    return known


def salt_root(salt: str) -> BlockHash:
    """The chain root of requests with vLLM's `cache_salt`: they share cached blocks
    only with requests of the same salt."""
    return hashlib.blake2b(b"cache_salt\0" + salt.encode(), digest_size=16).digest()


def draft_key(block: BlockHash, following: Sequence[int]) -> BlockHash:
    """The drafter's key for a block: its chain hash and the K tokens that follow it (the
    MTP KV at the block's last position reads x[p+K])."""
    return block_hash(block, following)


class PrefixCache:
    """Cached blocks of one pool by hash; the unreferenced ones in LRU order.

    Counters: `queries` prompt tokens looked up, `hits` of them found (vLLM's
    prefix_cache_queries/hits)."""

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # oldest first
        # the K tokens after a cached block in the last drafter keys sent for it (newest
        # last; `note_after`, `draft_key` covers them): the verifier's admission reads them
        self._after: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.queries = self.hits = 0

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes` (a chain: stops at a miss)."""
        out = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def lookup(self, h: BlockHash) -> int | None:
        return self._by_hash.get(h)

    def insert(self, h: BlockHash, block: int) -> bool:
        """Cache a full, committed block under `h`. False when `h` is cached already (the
        same content in another block: this one stays private) or `block` is."""
        if h in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[h], self._hash_of[block] = block, h
        return True

    def holds(self, block: int) -> bool:
        return block in self._hash_of

    def note_after(self, block: int, following: tuple[int, ...]) -> None:
        """A drafter was sent the key of cached `block` followed by `following` (the
        last AFTER_KEPT such keys are kept: a shared prompt's last block is followed by
        every user's message)."""
        if block not in self._hash_of:
            return
        seen = self._after.setdefault(block, OrderedDict())
        seen[following] = None
        seen.move_to_end(following)
        if len(seen) > AFTER_KEPT:
            seen.popitem(last=False)

    def noted(self, block: int, following: tuple[int, ...]) -> bool:
        """Whether a drafter was sent the key of cached `block` followed by `following`
        (lately): the drafter most likely holds its MTP KV under that key."""
        return following in self._after.get(block, ())

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def park(self, block: int) -> None:
        """A cached block lost its last user: most recently used of the idle ones."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """An idle cached block has a user again (it cannot be evicted now)."""
        del self._idle[block]

    def evict(self) -> int:
        """Forget the least recently used idle block and hand it out."""
        block, _ = self._idle.popitem(last=False)
        del self._by_hash[self._hash_of.pop(block)]
        self._after.pop(block, None)
        return block

    def record(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

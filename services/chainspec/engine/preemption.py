"""Preemption by recompute: when the block pool runs out mid-decode, the most recently
admitted running sequences give their blocks back and wait to be prefilled again.

A preempted request keeps every committed token. On readmission it prefills positions
0..N-1 (prompt and generated tokens alike) without sampling, then verifies x[N] as
before; greedy and seeded sampling depend only on committed tokens and positions, so
the client sees the same tokens (tested: `tests/unit/test_preemption.py`).

Admission reads the longest cached prefix first (DESIGN 4.12, engine/prefix_cache.py), and
committed full blocks are cached as they fill, so a readmitted sequence usually finds most
of its own blocks still cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from chainspec.engine.block_allocator import BlockAllocator
from chainspec.engine.kv_groups import CacheClaims
from chainspec.engine.prefix_cache import chain_hashes
from chainspec.engine.request import Request
from chainspec.engine.schedule import Work


def reserve(work: Sequence[Work], running: Sequence[Request], allocator: BlockAllocator
            ) -> tuple[list[Work], list[Request]]:
    """Give every work item the blocks its rows write. Short of blocks, preempt running
    sequences newest first (possibly the item's own). Returns the work that keeps its
    blocks and the preempted sequences (blocks already freed), newest first.

    NOTE: `running` is in admission order, so the oldest sequence is preempted last; alone
    it always fits (add_request refuses what the whole pool cannot hold): progress."""
    victims: list[Request] = []
    for item in work:
        req = item.request
        if any(v is req for v in victims):
            continue
        while not req.blocks.ensure(allocator, item.start + item.num_rows):
            victim = next(r for r in reversed(running) if not any(v is r for v in victims))
            victim.blocks.release(allocator)
            victims.append(victim)
            if victim is req:
                break
    kept = [w for w in work if not any(v is w.request for v in victims)]
    return kept, victims


def requeue(req: Request) -> None:
    """Reset a preempted request to recompute its committed prefix."""
    req.recompute_len = len(req.tokens) - 1 if req.num_generated else 0
    req.num_computed = 0
    req.drafts, req.drafter_synced, req.resync_at = None, False, None
    req.drafts_ahead, req.ahead = False, None  # a look-ahead is for a round now gone
    req.prefix_hit = req.num_cached = 0
    req.preemptions += 1


def admit_blocks(req: Request, allocator: BlockAllocator, num_steps: int, follow: int = 0,
                 claims: CacheClaims | None = None) -> bool:
    """Admission by free blocks: the whole prefill plus one verify window, or nothing.

    With prefix caching the table starts with the longest cached prefix (shared), whose
    positions skip prefill. It ends at a block boundary before the last prompt row (the
    engine needs that row's logits), so the rows computed write only this sequence's own
    blocks, never a shared one (vLLM recomputes only the last token, into the shared
    block). `follow` (K with a drafter): a drafter block's MTP KV depends on the K tokens
    after it too, and the drafter restores a hit only whole, so the hit ends at the first
    block whose key, with this prompt's next K tokens, the drafter was not sent
    (`PrefixCache.noted`). Blocks past it are recomputed: cheaper than the drafter
    missing, which rebuilds the whole prefix (a resync).
    `claims` (the engine's other cache groups): the hit ends where they can start too
    (`CacheClaims.usable`: the state snapshot at its end, which `CacheClaims.claim` then
    loads; the window blocks its next row sees, adopted here)."""
    need = len(req.tokens) + num_steps + 1
    cache = allocator.cache
    if cache is None:
        return req.blocks.ensure(allocator, need)
    limit = max(0, req.prefill_len - 1) // allocator.block_size
    hit = cache.match(chain_hashes(req.tokens, allocator.block_size, req.block_hashes,
                                   limit, req.hash_root)[:limit])
    if follow:  # NOTE: a block below a miss is useless to the drafter: it reads a prefix
        bs = allocator.block_size
        known = next((i for i, b in enumerate(hit) if not cache.noted(
            b, tuple(req.tokens[(i + 1) * bs:(i + 1) * bs + follow]))), len(hit))
        hit = hit[:known]
    while claims is not None and hit and not claims.usable(req.block_hashes, len(hit)):
        hit.pop()
    idle = sum(cache.is_idle(b) for b in hit)  # NOTE: held from now on, no longer free
    if allocator.blocks_for(need) - len(hit) > allocator.num_free - idle:
        return False
    req.blocks.adopt(allocator, hit)
    if claims is not None and hit:
        claims.adopt(req.claims, req.block_hashes, len(hit))
    if not req.blocks.ensure(allocator, need):
        raise RuntimeError("admission counted blocks it could not take")
    req.num_cached = len(hit)
    req.num_computed = req.prefix_hit = len(hit) * allocator.block_size
    cache.record(req.prefill_len, req.prefix_hit)
    if not req.preemptions:
        req.stats.cached_tokens = min(req.prefix_hit, req.prompt_len)
    return True


def cache_committed(req: Request, allocator: BlockAllocator,
                    claims: CacheClaims | None = None) -> None:
    """Cache the full blocks below `num_computed`: their KV holds committed tokens only
    (rejected drafts' rows lie at or past num_computed), and nothing writes them again.
    NOTE: only blocks whose tokens `req.tokens` holds: the hash needs them (a verify
    window's accepted drafts are appended after its rows are computed). `claims`: the
    window tables' blocks too (before they are trimmed)."""
    cache, bs = allocator.cache, allocator.block_size
    full = min(req.num_computed, len(req.tokens)) // bs
    if cache is None or full <= req.num_cached:
        return
    hashes = chain_hashes(req.tokens, bs, req.block_hashes, full, req.hash_root)
    for i in range(req.num_cached, full):
        cache.insert(hashes[i], req.blocks.blocks[i])
    if claims is not None:
        claims.cache_blocks(req.claims, hashes, req.num_cached, full)
    req.num_cached = full

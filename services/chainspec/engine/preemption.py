"""Preemption by recompute: when the block pool runs out mid-decode, the most recently
admitted running sequences give their blocks back and wait to be prefilled again.

A preempted request keeps every committed token. On readmission it prefills positions
0..N-1 (prompt and generated tokens alike) without sampling, then verifies x[N] as
before; greedy and seeded sampling depend only on committed tokens and positions, so
the client sees the same tokens (tested: `tests/unit/test_preemption.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from chainspec.engine.block_allocator import BlockAllocator
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
    req.preemptions += 1


def admit_blocks(req: Request, allocator: BlockAllocator, num_steps: int) -> bool:
    """Admission by free blocks: the whole prefill plus one verify window, or nothing."""
    return req.blocks.ensure(allocator, len(req.tokens) + num_steps + 1)

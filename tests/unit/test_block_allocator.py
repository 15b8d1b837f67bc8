"""Block allocator and block tables: all-or-nothing allocation, no block handed out twice,
frees return every block."""

from __future__ import annotations

import random

import pytest

from chainspec.engine.block_allocator import BlockAllocator, BlockTable
from chainspec.engine.kv_budget import KVBudget


def test_allocation_is_all_or_nothing() -> None:
    alloc = BlockAllocator(5, 16)
    got = alloc.allocate(3)
    assert got is not None and len(set(got)) == 3 and alloc.num_free == 2
    assert alloc.allocate(3) is None and alloc.num_free == 2  # nothing taken
    assert alloc.usage == 3 / 5


def test_block_table_grows_by_positions_and_keeps_its_blocks_when_short() -> None:
    alloc = BlockAllocator(4, 4)
    table = BlockTable()
    assert table.ensure(alloc, 1) and len(table) == 1
    assert table.ensure(alloc, 4) and len(table) == 1  # positions 0..3 fit one block
    assert table.ensure(alloc, 5) and len(table) == 2
    before = list(table.blocks)
    assert not table.ensure(alloc, 17)  # needs 5 blocks, the pool has 4
    assert table.blocks == before and alloc.num_free == 2
    table.release(alloc)
    assert len(table) == 0 and alloc.num_free == 4


def test_random_traffic_never_hands_out_a_block_twice() -> None:
    rng = random.Random(0)
    alloc = BlockAllocator(64, 8)
    tables = [BlockTable() for _ in range(10)]
    for _ in range(2000):
        t = rng.choice(tables)
        if rng.random() < 0.2:
            t.release(alloc)
        else:
            t.ensure(alloc, rng.randint(1, 120))
        held = [b for x in tables for b in x.blocks]
        assert len(held) == len(set(held)) == alloc.num_used
        assert all(0 <= b < 64 for b in held)
    for t in tables:
        t.release(alloc)
    assert alloc.num_free == 64


def test_budget_turns_bytes_into_blocks() -> None:
    import torch
    cpu = torch.device("cpu")
    assert KVBudget(memory_bytes=10_000).num_blocks(1000, 8, 1024, cpu) == 10
    assert KVBudget(blocks=7).num_blocks(1000, 8, 1024, cpu) == 7
    assert KVBudget(block_size=16).num_blocks(1000, 8, 1000, cpu) == 8 * 63  # fixed slots
    with pytest.raises(ValueError, match="one of"):
        KVBudget(memory_bytes=1, blocks=1)
    with pytest.raises(ValueError, match="fraction"):
        KVBudget(fraction=1.5)


def test_fraction_is_of_the_memory_free_after_cached_blocks_are_handed_back(monkeypatch
                                                                            ) -> None:
    """A CUDA fraction budget reads free memory after emptying the allocator's cache
    (what the weight loads left reserved but unused counts as free), then takes
    `fixed_bytes` off before dividing."""
    import torch
    calls, state = [], {"cached": 4_000}

    def empty_cache():
        calls.append("empty_cache")
        state["cached"] = 0

    def mem_get_info(device):
        calls.append("mem_get_info")
        return 100_000 - state["cached"], 200_000

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    blocks = KVBudget(fraction=0.5).num_blocks(1000, 8, 1024, torch.device("cuda"),
                                               fixed_bytes=2_000)
    assert calls == ["empty_cache", "mem_get_info"]
    assert blocks == (50_000 - 2_000) // 1000

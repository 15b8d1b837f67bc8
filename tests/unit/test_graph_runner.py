"""Static-buffer discipline: the bucketed buffer path equals the compact eager path, padding
writes no KV, and returned outputs survive the next round."""

from __future__ import annotations

import random

import pytest
import torch

from chainspec.engine.draft_batch import Window, build_compact
from chainspec.engine.draft_step import draft_round
from chainspec.engine.graph_runner import GraphRunner, StaticDraftBuffers, default_buckets
from chainspec.models.kv_cache import ModelKVCache
from tests.unit.tiny_models import tiny_draft_model

K, HIDDEN, MAX_LEN, TOP_K = 3, 32, 64, 4
BLOCK, NUM_BLOCKS = 4, 8 * 64 // 4


def windows(n: int, rng: random.Random, sampled: bool = False) -> list[Window]:
    out = []
    pool = list(range(NUM_BLOCKS))
    rng.shuffle(pool)  # each sequence's blocks are scattered through the cache
    for s in range(n):
        rows = rng.randint(1, 2 * K)
        first = rng.randint(0, 20)
        need = (first + rows + BLOCK - 1) // BLOCK
        blocks = tuple(pool[s * 16: s * 16 + need])
        out.append(Window(blocks=blocks, first_pos=first, hidden=torch.randn(rows, HIDDEN),
                          tokens=torch.randint(0, 61, (rows,)),
                          temperature=0.7 if sampled and s % 2 else 0.0, seed=100 + s))
    return out


def fresh_cache(model) -> ModelKVCache:
    cfg = model.config
    cache = ModelKVCache.uniform(K, NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    for t in cache.keys + cache.values:  # distinct pre-existing content
        t.copy_(torch.randn_like(t))
    return cache


def test_buckets() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("sampled", [False, True])
def test_static_path_equals_compact_eager_path(num_seqs: int, sampled: bool) -> None:
    model = tiny_draft_model(2)
    wins = windows(num_seqs, random.Random(num_seqs), sampled)
    cache_a, cache_b = fresh_cache(model), fresh_cache(model)
    for a, b in zip(cache_a.keys + cache_a.values, cache_b.keys + cache_b.values, strict=True):
        b.copy_(a)
    compact = draft_round(model, cache_a, build_compact(wins, K, BLOCK, "cpu", torch.float32),
                          K, True, TOP_K)
    buffers = StaticDraftBuffers(8, K, HIDDEN, MAX_LEN, BLOCK, torch.device("cpu"),
                                 torch.float32)
    runner = GraphRunner(lambda b, d: draft_round(model, cache_b, b, d, True, TOP_K), buffers,
                         default_buckets(8), use_graphs=False)
    out = runner.run(wins)
    assert runner.dispatch(num_seqs).batch_size >= num_seqs
    assert torch.equal(out.tokens, compact.tokens)
    torch.testing.assert_close(out.probs, compact.probs)
    for a, b in zip(cache_a.keys + cache_a.values, cache_b.keys + cache_b.values, strict=True):
        # Same KV writes (float tolerance: matmuls over different row counts may block
        # differently), and padding wrote nowhere.
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_padding_rows_write_no_kv() -> None:
    model = tiny_draft_model(2)
    cache = fresh_cache(model)
    before = [t.clone() for t in cache.keys + cache.values]
    wins = windows(3, random.Random(3))
    buffers = StaticDraftBuffers(8, K, HIDDEN, MAX_LEN, BLOCK, torch.device("cpu"),
                                 torch.float32)
    runner = GraphRunner(lambda b, d: draft_round(model, cache, b, d, True, TOP_K), buffers,
                         [8], use_graphs=False)  # 3 real sequences padded to 8
    runner.run(wins)
    written = torch.zeros(NUM_BLOCKS, BLOCK, dtype=torch.bool)
    for w in wins:
        for p in range(w.first_pos, w.first_pos + w.num_rows):
            written[w.blocks[p // BLOCK], p % BLOCK] = True
    for old, new in zip(before, cache.keys + cache.values, strict=True):
        changed = (old != new).any(-1).any(-1)  # [blocks, offsets]
        assert not (changed & ~written).any(), "a padding row wrote KV"
        assert changed[written].all(), "a real row did not write KV"


def test_outputs_survive_the_next_round() -> None:
    model = tiny_draft_model(2)
    cache = fresh_cache(model)
    buffers = StaticDraftBuffers(4, K, HIDDEN, MAX_LEN, BLOCK, torch.device("cpu"),
                                 torch.float32)
    runner = GraphRunner(lambda b, d: draft_round(model, cache, b, d, True, TOP_K), buffers,
                         [4], use_graphs=False)
    first = runner.run(windows(2, random.Random(1)))
    kept = first.tokens.clone()
    runner.run(windows(2, random.Random(2)))
    assert torch.equal(first.tokens, kept)

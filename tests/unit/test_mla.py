"""The `mla` layer kind (models/mla.py): the absorbed form that every backend runs equals
the textbook expanded form (per-head K/V from kv_b_proj) within fp32 tolerance, densely
and through a paged latent cache whose values are a view of the keys' first r channels;
and the cache holds one latent head of r + Dr channels per position, nothing per head."""

from __future__ import annotations

import pytest
import torch

from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.config import RopeConfig
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.mla import LatentAttention, MLAShape
from chainspec.models.rope import RotaryEmbedding

HEADS, RANK, NOPE, ROPE, V = 4, 16, 8, 4, 12
BLOCK = 4


def layer(q_rank: int | None, interleave: bool, seed: int = 0) -> LatentAttention:
    shape = MLAShape(hidden_size=32, num_heads=HEADS, q_lora_rank=q_rank, kv_lora_rank=RANK,
                     qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                     scale=0.37, rope_interleave=interleave, bias=True)
    torch.manual_seed(seed)
    mla = LatentAttention(shape, 0, RotaryEmbedding(RopeConfig(), ROPE, 64))
    with torch.no_grad():
        for p in mla.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2 if p.dim() == 1 else 0.4)
    return mla.eval()


@pytest.mark.parametrize("q_rank", [None, 24], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half"])
@torch.no_grad()
def test_absorbed_equals_expanded_dense(q_rank, interleave):
    mla, x = layer(q_rank, interleave), torch.randn(2 * 9, 32)
    want = mla.expanded(x, torch.arange(9).repeat(2), DenseCausal(2, 9))
    got = mla(x, torch.arange(9).repeat(2), DenseCausal(2, 9))
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_absorbed_through_the_latent_paged_cache_equals_expanded():
    """Two sequences in two packed steps (a prefill chunk, then a verify-sized window),
    blocks out of order: the latent cache's keys and its value view serve every row."""
    mla = layer(24, True)
    xs = {0: torch.randn(11, 32), 1: torch.randn(7, 32)}
    want = {s: mla.expanded(x, torch.arange(len(x)), DenseCausal(1, len(x)))
            for s, x in xs.items()}
    cache = ModelKVCache([mla.cache_spec()], {None: 8}, BLOCK)
    tables = {0: [5, 0, 7], 1: [1, 6]}
    got = {0: [], 1: []}
    for step in ({0: (0, 6), 1: (0, 3)}, {0: (6, 11), 1: (3, 7)}):
        batch = AttnBatch.build([SeqRows(tables[s], lo, hi - lo) for s, (lo, hi) in
                                 step.items()], BLOCK)
        x = torch.cat([xs[s][lo:hi] for s, (lo, hi) in step.items()])
        out = mla(x, batch.positions, PagedAttention(cache, batch))
        for s, part in zip(step, out.split([hi - lo for lo, hi in step.values()]),
                           strict=True):
            got[s].append(part)
    for s in xs:
        torch.testing.assert_close(torch.cat(got[s]), want[s], atol=2e-5, rtol=1e-5)


def test_cache_is_one_latent_head():
    spec = layer(None, True).cache_spec()
    assert (spec.num_kv_heads, spec.head_dim, spec.value_dim, spec.latent) == (
        1, RANK + ROPE, RANK, True)
    cache = ModelKVCache([spec], {None: 3}, BLOCK)
    entry = cache.paged(0)
    assert entry.values.data_ptr() == entry.keys.data_ptr()  # values: a view of c_kv
    assert entry.values.shape[-1] == RANK
    assert cache.bytes() == 3 * BLOCK * (RANK + ROPE) * 4  # no per-head K/V stored

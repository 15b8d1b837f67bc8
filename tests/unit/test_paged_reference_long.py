"""The paged-attention reference past SDPA_MAX_KEYS (two matmuls, the mask on the tail
columns only) and its per-step plan: equal to an fp64 per-row oracle for long verify
windows, long groups with padding rows and keys, and rows packed out of order; a key
past a row's position, even NaN, never reaches that row; row spans tile the packed rows
in order when they can (no scatter, no zeros)."""

from __future__ import annotations

import pytest
import torch

from chainspec.kernels.paged_reference import (
    SDPA_MAX_KEYS,
    paged_attention_reference,
    reference_plan,
)

BS, D, BLOCKS, WIDTH = 16, 16, 400, 120
# (sequence, first position, rows) in packing order; -1: a padding row
CASES = {
    "verify_long_and_short": [(0, 37, 4), (1, 1496, 4)],  # the mixed-lengths step
    "long_group_padding": [(2, 700, 1), (0, 600, 4), (-1, 0, 1), (1, 9, 2)],  # one group
    "prefill_chunk": [(0, 520, 64), (1, 3, 1)],  # 64 rows over keys 0..583
}


def _batch(spans: list[tuple[int, int, int]], hq: int, hkv: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(2, BLOCKS, BS, hkv, D, generator=gen)
    tables = torch.randperm(BLOCKS, generator=gen)[:3 * WIDTH].view(3, WIDTH).int()
    row_seq = torch.tensor([s for s, _, n in spans for _ in range(n)])
    positions = torch.tensor([p for s, p0, n in spans for p in range(p0, p0 + n)])
    q = torch.randn(len(row_seq), hq, D, generator=gen)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
            "row_seq": row_seq, "positions": positions, "scale": 0.25}


def _oracle(a: dict) -> torch.Tensor:
    """Each row over its own sequence's keys 0..position, in fp64 (padding rows: 0)."""
    q, hq, hkv = a["q"].double(), a["q"].shape[1], a["k_cache"].shape[2]
    out = torch.zeros_like(q)  # [T, Hq, D]
    for t, (s, p) in enumerate(zip(a["row_seq"].tolist(), a["positions"].tolist(),
                                   strict=True)):
        if s < 0:
            continue
        blocks = a["block_tables"][s].long()
        k, v = (c[blocks].flatten(0, 1)[: p + 1].double().repeat_interleave(hq // hkv, 1)
                for c in (a["k_cache"], a["v_cache"]))  # [p + 1, Hq, D]
        w = torch.einsum("hd,khd->hk", q[t], k).mul(a["scale"]).softmax(-1)  # [Hq, p + 1]
        out[t] = torch.einsum("hk,khd->hd", w, v)
    return out


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1), (2, 2)])
def test_long_groups_match_fp64_oracle(name: str, hq: int, hkv: int) -> None:
    a = _batch(CASES[name], hq, hkv, seed=hq * 7 + hkv)
    got = paged_attention_reference(**a)
    assert got.shape == a["q"].shape and got.dtype == a["q"].dtype
    torch.testing.assert_close(got.double(), _oracle(a), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", CASES)
def test_keys_past_a_row_never_reach_it_even_nan(name: str) -> None:
    """In a long group, NaN in a key past the row's position (its own window's later keys,
    the stale rest of its last block) and in blocks no sequence owns: the row's output is
    unchanged. (Not asserted for SDPA's short groups: its additive mask lets NaN through.)"""
    a = _batch(CASES[name], 4, 2, seed=3)
    base = paged_attention_reference(**a)
    k_cache = a["k_cache"].clone()
    owned = set(a["block_tables"].flatten().tolist())
    k_cache[[b for b in range(BLOCKS) if b not in owned]] = float("nan")
    seq = int(a["row_seq"][a["positions"].argmax()])  # in the long group
    t = int((a["row_seq"] == seq).nonzero()[0])  # its first row: its later keys go NaN
    pos = int(a["positions"][t])
    assert pos + 1 > SDPA_MAX_KEYS
    table = a["block_tables"][seq].long()
    for p in range(pos + 1, (pos // BS + 2) * BS):
        k_cache[table[p // BS], p % BS] = float("nan")
    got = paged_attention_reference(**{**a, "k_cache": k_cache})
    assert torch.equal(got[t], base[t])


def test_mixed_step_plan_masks_only_the_window_and_tiles_the_rows() -> None:
    """7 short verify windows then one long one, packed in order: two groups whose spans
    tile the rows (outputs concatenated, nothing scattered), and the long group masks its
    last 3 key columns only (its rows see every earlier key)."""
    k = 3
    spans = [(s, 40 + 9 * s, k + 1) for s in range(7)] + [(7, 1996, k + 1)]
    row_seq = torch.tensor([s for s, _, n in spans for _ in range(n)])
    positions = torch.tensor([p for s, p0, n in spans for p in range(p0, p0 + n)])
    tables = torch.arange(8 * 128, dtype=torch.int32).view(8, 128)
    plan = reference_plan(tables, row_seq, positions, BS)
    assert plan.tiles and [g.span for g in plan.groups] == [(0, 28), (28, 32)]
    long = plan.groups[1]
    assert long.length == 2000 > SDPA_MAX_KEYS and long.seen == 2000 - k
    assert long.tail.shape[-1] == k and long.tail[0, 0, 0].tolist() == [
        [i < j for j in range(1, k + 1)] for i in range(k + 1)]


@pytest.mark.parametrize("spans,tiles", [
    ([(1, 800, 2), (0, 5, 3)], True),  # in packed order, the long one first
    ([(0, 5, 1), (1, 800, 2), (0, 6, 1)], False),  # a sequence's rows are split
    ([(0, 5, 2), (-1, 0, 1)], False),  # a padding row must come back as zeros
])
def test_plan_tiles_only_when_the_spans_cover_every_row(spans, tiles: bool) -> None:
    a = _batch(spans, 4, 2, seed=11)
    plan = reference_plan(a["block_tables"], a["row_seq"], a["positions"], BS)
    assert plan.tiles == tiles
    got = paged_attention_reference(**a, plan=plan)
    torch.testing.assert_close(got.double(), _oracle(a), atol=2e-5, rtol=2e-5)

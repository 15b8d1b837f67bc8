"""Fused MoE: the expert sort is a padded permutation of the (row, slot) pairs with one
expert per block; the Triton kernel (interpreted) equals the torch reference on randomised
shapes (experts 8-64, top-k 1-8, rows 1-512), uneven loads and experts with no rows."""

from __future__ import annotations

import pytest
import torch

from chainspec.kernels.fused_moe import (
    align_block_size,
    fused_moe,
    fused_moe_reference,
    padded_bound,
    pick_tiles,
)
from tests.unit.kernels.interpreted import interpreted_results

interpreted = interpreted_results(__name__)
# (rows, experts, top_k, hidden, intermediate): decode, verify and prefill-sized; hidden and
# intermediate sizes off the tile sizes exercise the masks
SHAPES = [(1, 64, 8, 32, 16), (3, 8, 1, 40, 24), (12, 16, 4, 32, 16), (37, 64, 6, 24, 40),
          (130, 8, 2, 32, 16), (512, 32, 8, 16, 16)]


def _weights(e: int, h: int, i: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dtype)  # [E, 2I, H]
    down = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(dtype)  # [E, H, I]
    return gate_up, down


def _routing(rows: int, e: int, k: int, seed: int, skew: bool = False):
    """Distinct experts per row (as top-k gives); `skew`: most rows pick the same few
    experts and some experts get none."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, e, generator=g)
    if skew:
        scores[:, : max(k, 2)] += 2.0 * (torch.rand(rows, 1, generator=g) < 0.8)
        scores[:, -(e // 4):] = -1.0  # the last quarter of the experts: no rows
    ids = torch.topk(scores, k, dim=-1).indices  # [T, k]
    return ids, torch.rand(rows, k, generator=g)


def _case(rows, e, k, h, i, dtype, seed, skew=False):
    x = torch.randn(rows, h, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return (x, *_weights(e, h, i, dtype, seed + 1), *_routing(rows, e, k, seed + 2, skew))


# ---------------------------------------------------------------------------------------
# In this process: the sort, the tile choice, the CPU dispatch.


@pytest.mark.parametrize("rows, e, k", [(1, 64, 8), (5, 8, 2), (100, 16, 4), (9, 64, 1)])
def test_align_is_a_padded_permutation_with_one_expert_per_block(rows, e, k) -> None:
    ids, _ = _routing(rows, e, k, seed=rows, skew=rows == 100)
    bm = 16
    blocks = align_block_size(ids, e, bm)
    pairs = rows * k
    total = int(blocks.total)
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert total == int(((counts + bm - 1) // bm * bm).sum())
    assert blocks.sorted_pairs.numel() == padded_bound(pairs, e, bm) >= total
    used = blocks.sorted_pairs[:total]
    real = used[used < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    assert (blocks.sorted_pairs[total:] == pairs).all()  # the rest is padding
    flat = ids.flatten()
    for b in range(total // bm):
        chunk = used[b * bm:(b + 1) * bm]
        chunk = chunk[chunk < pairs].long()
        assert chunk.numel() > 0, "a block with no pair: padding past one block"
        assert (flat[chunk] == blocks.block_expert[b]).all()
        assert torch.equal(chunk, chunk.sort().values)  # row order within an expert


def test_tiles_follow_rows_per_expert() -> None:
    assert pick_tiles(4, 8, 256, torch.bfloat16).block_m == 16  # decode / verify
    assert pick_tiles(2048, 8, 256, torch.bfloat16).block_m == 64  # a prefill chunk
    assert pick_tiles(2048, 8, 8, torch.float32).block_m == 16  # fp32: FMA dots


def test_reference_is_the_per_pair_sum() -> None:
    x, gate_up, down, ids, w = _case(6, 8, 3, 16, 8, torch.float32, seed=0)
    want = torch.zeros_like(x)
    for t in range(6):
        for j in range(3):
            g, u = (gate_up[ids[t, j]] @ x[t]).chunk(2)
            want[t] += w[t, j] * (down[ids[t, j]] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(fused_moe_reference(x, gate_up, down, ids, w), want)


def _drop_some(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """ids [T, k] with about half the pairs -1 (no expert here: another rank's)."""
    drop = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    return torch.where(drop, torch.full_like(ids, -1), ids)


def test_pairs_with_no_expert_add_nothing() -> None:
    x, gate_up, down, ids, w = _case(9, 8, 3, 16, 8, torch.float32, seed=2)
    ids = _drop_some(ids, seed=3)
    assert (ids < 0).any() and (ids >= 0).any()
    want = fused_moe_reference(x, gate_up, down, ids.clamp(min=0), w * (ids >= 0))
    torch.testing.assert_close(fused_moe_reference(x, gate_up, down, ids, w), want)
    none = torch.full_like(ids, -1)
    assert torch.equal(fused_moe_reference(x, gate_up, down, none, w), torch.zeros_like(x))


def test_align_leaves_out_pairs_with_no_expert() -> None:
    ids, _ = _routing(40, 16, 4, seed=5)
    ids = _drop_some(ids, seed=6)
    bm, pairs = 16, ids.numel()
    blocks = align_block_size(ids, 16, bm)
    total = int(blocks.total)
    counts = torch.bincount(ids[ids >= 0], minlength=16)
    assert total == int(((counts + bm - 1) // bm * bm).sum())
    used = blocks.sorted_pairs[:total]
    real = used[used < pairs]
    assert sorted(real.tolist()) == torch.nonzero(ids.flatten() >= 0).flatten().tolist()
    assert (blocks.sorted_pairs[total:] == pairs).all()


def test_cpu_dispatch_takes_the_reference() -> None:
    args = _case(5, 8, 2, 16, 8, torch.float32, seed=1)
    assert torch.equal(fused_moe(*args), fused_moe_reference(*args))


# ---------------------------------------------------------------------------------------
# Under TRITON_INTERPRET=1 (tests/unit/kernels/interpreted.py).


def _check(args, rtol, atol) -> None:
    got, want = fused_moe(*args), fused_moe_reference(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def check_fp32_random_shapes() -> None:
    for n, (rows, e, k, h, i) in enumerate(SHAPES):
        _check(_case(rows, e, k, h, i, torch.float32, seed=10 * n), rtol=1e-5, atol=1e-5)


def check_fp32_sampled_shapes() -> None:
    """Shapes drawn from the ranges (seeded): experts 8-64, top-k 1-8, rows 1-512."""
    g = torch.Generator().manual_seed(21)
    for n in range(5):
        e = int(torch.randint(8, 65, (), generator=g))
        k = int(torch.randint(1, 9, (), generator=g))
        rows = int(torch.randint(1, 513, (), generator=g)) if n else 512
        _check(_case(rows, e, k, 24, 16, torch.float32, seed=100 + n), rtol=1e-5, atol=1e-5)


def check_uneven_loads_and_idle_experts() -> None:
    for rows, e, k in ((64, 16, 2), (200, 32, 4), (2, 64, 3)):
        args = _case(rows, e, k, 32, 16, torch.float32, seed=rows, skew=True)
        counts = torch.bincount(args[3].flatten(), minlength=e)
        assert (counts == 0).any()  # idle experts
        assert rows < 64 or counts.max() > 16  # one expert over several blocks
        _check(args, rtol=1e-5, atol=1e-5)


def check_half_precision() -> None:
    """bf16/fp16 weights: the kernel keeps gate/up in fp32 until the act, the reference
    rounds each linear, so they differ by a few roundings of the output dtype."""
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 4e-3)):
        for rows, e, k, skew in ((20, 16, 4, False), (130, 8, 2, True)):
            block_m = pick_tiles(rows, k, e, dtype).block_m
            assert block_m == (16 if rows == 20 else 64)  # both tile shapes run
            _check(_case(rows, e, k, 40, 24, dtype, seed=rows, skew=skew), rtol=tol, atol=tol)


def check_clamped_swiglu() -> None:
    """Step-3.5's routed experts: min(silu(g), limit) * clamp(u, +-limit); the limit is
    small enough that most activations are clamped, so an unclamped kernel fails."""
    for rows, e, k in ((20, 16, 4), (130, 8, 2)):
        args = (*_case(rows, e, k, 32, 16, torch.float32, seed=rows), 0.05)
        plain = fused_moe_reference(*args[:5])
        assert (plain - fused_moe_reference(*args)).abs().max() > 1e-3
        _check(args, rtol=1e-5, atol=1e-5)


def check_pairs_with_no_expert() -> None:
    """Expert parallel: pairs of other ranks' experts (id -1) are neither computed nor
    summed, whatever the kernel's output buffer held."""
    for rows, e, k in ((20, 16, 4), (130, 8, 2)):
        x, gate_up, down, ids, w = _case(rows, e, k, 32, 16, torch.float32, seed=rows)
        _check((x, gate_up, down, _drop_some(ids, seed=rows + 1), w), rtol=1e-5, atol=1e-5)


CHECKS = sorted(n for n in globals() if n.startswith("check_"))


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_in_interpreter(name: str, interpreted: dict[str, str]) -> None:
    assert interpreted[name] == "", interpreted[name]

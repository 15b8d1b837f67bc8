"""KV store: rows land at block * block_size + offset, cast to the cache dtype, padding rows
(slot -1) write nowhere: the whole cache is compared with one built row by row. The torch
reference here, the Triton kernel in Triton's interpreter (a child process)."""

from __future__ import annotations

import sys

import pytest
import torch

from chainspec.kernels.kv_store import store_kv, store_kv_reference
from tests.unit.kernels.interpreted import assert_kernel_equal, interpreted_results
from tests.unit.kernels.interpreted import check_names as _check_names

# (kv heads, head dim, block size, row dtype, cache dtype, strided rows)
SHAPES = {
    "h2_d32_bs16_f32": (2, 32, 16, torch.float32, torch.float32, False),
    "h3_d64_bs8_f32_into_bf16": (3, 64, 8, torch.float32, torch.bfloat16, False),
    "h8_d128_bs16_f16_strided": (8, 128, 16, torch.float16, torch.float16, True),
    "h1_d16_bs32_bf16": (1, 16, 32, torch.bfloat16, torch.bfloat16, False),
    "h4_d48_v24_bs4_f32": (4, 48, 4, torch.float32, torch.float32, True),
    "h2_d192_v128_bs16_bf16": (2, 192, 16, torch.bfloat16, torch.bfloat16, False),
}
V_DIM = {"h4_d48_v24_bs4_f32": 24, "h2_d192_v128_bs16_bf16": 128}  # values unlike keys


def _inputs(name: str, rows: int = 23, num_blocks: int = 7) -> tuple:
    heads, dim, bs, dtype, cache_dtype, strided = SHAPES[name]
    v_dim = V_DIM.get(name, dim)
    gen = torch.Generator().manual_seed(len(name))
    k_cache = torch.randn(num_blocks, bs, heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, heads, v_dim, generator=gen).to(cache_dtype)
    kv = torch.randn(rows, heads * (2 * dim + v_dim), generator=gen).to(dtype)  # [T, q|k|v]
    k = kv[:, heads * dim: 2 * heads * dim].view(rows, heads, dim)
    v = kv[:, 2 * heads * dim:].view(rows, heads, v_dim)
    if not strided:
        k, v = k.contiguous(), v.contiguous()
    slots = torch.randperm(num_blocks * bs, generator=gen)[:rows]
    slots[torch.randperm(rows, generator=gen)[:5]] = -1  # padding rows
    slots[0] = num_blocks * bs - 1  # the very last slot
    return k, v, k_cache, v_cache, slots


def _expected(k, v, k_cache, v_cache, slots) -> tuple[torch.Tensor, torch.Tensor]:
    want_k, want_v = k_cache.clone(), v_cache.clone()
    bs = k_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k[slot // bs, slot % bs] = k[t].to(k_cache.dtype)
            want_v[slot // bs, slot % bs] = v[t].to(v_cache.dtype)
    return want_k, want_v


def _check_store(name: str, fn) -> None:
    k, v, k_cache, v_cache, slots = _inputs(name)
    want_k, want_v = _expected(k, v, k_cache, v_cache, slots)
    fn(k, v, k_cache, v_cache, slots)
    assert_kernel_equal(k_cache, want_k)  # bit-exact (one bf16 ulp in the interpreter,
    assert_kernel_equal(v_cache, want_v)  # which truncates fp32 -> bf16)


@pytest.mark.parametrize("name", SHAPES)
def test_reference_writes_exactly_the_mapped_slots(name: str) -> None:
    _check_store(name, store_kv)  # CPU tensors: the dispatch takes the reference


def test_all_padding_writes_nothing() -> None:
    k, v, k_cache, v_cache, slots = _inputs("h2_d32_bs16_f32")
    before = k_cache.clone()
    store_kv_reference(k, v, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.equal(k_cache, before)


def test_bad_shapes_are_refused() -> None:
    k, v, k_cache, v_cache, slots = _inputs("h2_d32_bs16_f32")
    with pytest.raises(ValueError, match="store_kv"):
        store_kv(k, v, k_cache, v_cache, slots[:-1])
    with pytest.raises(ValueError, match="store_kv"):
        store_kv(k[..., :-1], v[..., :-1], k_cache, v_cache, slots)


def _make_check(name: str):
    def check() -> None:
        _check_store(name, store_kv)  # inside kernels_on_cpu(): the Triton kernel
    return check


for _name in SHAPES:
    globals()[f"check_{_name}"] = _make_check(_name)

interpreted = interpreted_results(__name__)


@pytest.mark.parametrize("name", _check_names(sys.modules[__name__]))
def test_kernel_writes_exactly_the_mapped_slots(name: str, interpreted: dict[str, str]) -> None:
    assert interpreted[name] == "", interpreted[name]

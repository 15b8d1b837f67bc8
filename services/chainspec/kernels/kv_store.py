"""KV store: write this step's keys/values into a paged cache by slot mapping.

Cache layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` (values may be
narrower: `[..., v_head_dim]`); slot `block * block_size + offset`. Padding rows carry
slot -1 and write nowhere.
"""

from __future__ import annotations

import torch

from chainspec.kernels.triton_support import launcher, triton_available, use_kernel


def store_kv(k: torch.Tensor, v: torch.Tensor | None, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k `[T, Hkv, Dk]`, v `[T, Hkv, Dv]` into k_cache, v_cache
    `[blocks, block_size, Hkv, Dk | Dv]` at
    `slot_mapping` `[T]` (int64, -1 = padding row), in place, cast to the cache dtype.
    `v` None: a latent cache (values are a view of the keys), only k is written.
    The Triton kernel on CUDA tensors, the torch reference elsewhere."""
    if v is None:
        v, v_cache = k, k_cache  # NOTE: the kernel writes them twice (same values, slots)
    _check(k, v, k_cache, v_cache, slot_mapping)
    if use_kernel(k):
        _store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping)


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference (the CPU path). NOTE: boolean indexing syncs; CPU only."""
    valid = slot_mapping >= 0  # [T]
    every = bool(valid.all())  # no padding rows: no boolean indexing (CPU decode steps)
    slots = slot_mapping if every else slot_mapping[valid]  # [n]
    pairs = ((k, k_cache),) if v is k else ((k, k_cache), (v, v_cache))  # latent: once
    for src, cache in pairs:
        flat = cache.view(-1, *cache.shape[2:])  # [blocks * block_size, Hkv, D]
        flat.index_copy_(0, slots, (src if every else src[valid]).to(cache.dtype))


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    if (k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]
            or k_cache.shape[:3] != v_cache.shape[:3]):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, caches "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:] or v_cache.shape[3] != v.shape[2]:
        raise ValueError(f"store_kv: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} "
                         f"do not hold rows {tuple(k.shape[1:])}/{tuple(v.shape[1:])}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"store_kv: slot_mapping {tuple(slot_mapping.shape)} for "
                         f"{k.shape[0]} rows")


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                         num_heads, BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, DK_PAD: tl.constexpr,
                         DV_PAD: tl.constexpr):
        """One program per row: copy its [Hkv, Dk] keys and [Hkv, Dv] values to its slot."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            h = tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
            d = tl.arange(0, DK_PAD)[None, :]  # [1, Dk]
            e = tl.arange(0, DV_PAD)[None, :]  # [1, Dv]
            mk = (h < num_heads) & (d < HEAD_DIM)
            mv = (h < num_heads) & (e < V_DIM)
            key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mk)
            val = tl.load(v_ptr + t * stride_vt + h * stride_vh + e, mask=mv)
            kc = kc_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d
            vc = vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + e
            tl.store(kc, key.to(kc_ptr.dtype.element_ty), mask=mk)
            tl.store(vc, val.to(vc_ptr.dtype.element_ty), mask=mv)


def _store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    t, heads, dim = k.shape
    v_dim = v.shape[-1]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("store_kv: the head dimension must be contiguous")
    if t == 0:
        return
    launcher(_store_kv_kernel, k)[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        heads, BLOCK_SIZE=k_cache.shape[1], HEADS=triton.next_power_of_2(heads), HEAD_DIM=dim,
        V_DIM=v_dim, DK_PAD=triton.next_power_of_2(dim), DV_PAD=triton.next_power_of_2(v_dim))

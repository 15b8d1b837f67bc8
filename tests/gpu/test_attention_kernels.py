"""GPU-only: the Triton paged-attention and KV-store kernels against their torch references
on the same randomised cases the interpreter tests use (tests/unit/kernels), plus a
serving-sized batch and a CUDA-graph capture (the kernels' host prep must not sync).
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from chainspec.kernels.kv_store import store_kv
from chainspec.kernels.paged_attention import paged_attention, paged_attention_reference
from tests.unit.kernels.attention_cases import CASES, TOLERANCE, Case, build
from tests.unit.kernels.test_kv_store import SHAPES, _expected, _inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none visible to torch)")

SERVING = Case("serving_gqa8_d128_bf16", torch.bfloat16, 128, 8,
               ((0, 512), (1990, 1), (700, 8), (33, 1), (1500, 4), (0, 1), (64, 1), (300, 2)),
               kv_heads=4, seed=11)


def _check_attention(case: Case) -> None:
    args = build(case, device="cuda")["args"]
    got = paged_attention(**args)
    want = paged_attention_reference(**args)
    assert got.dtype == want.dtype and got.shape == want.shape
    pad = args["row_seq"] < 0
    assert torch.all(got[pad] == 0)
    err = (got.double() - want.double()).abs().max().item()
    assert err <= TOLERANCE[case.dtype], f"{case.name}: kernel vs reference {err}"


@pytest.mark.parametrize("case", [*CASES, SERVING], ids=lambda c: c.name)
def test_paged_attention_kernel_matches_reference(case: Case) -> None:
    _check_attention(case)


@pytest.mark.parametrize("name", SHAPES)
def test_store_kv_kernel_writes_exactly_the_mapped_slots(name: str) -> None:
    k, v, k_cache, v_cache, slots = (x.cuda() for x in _inputs(name))
    want_k, want_v = _expected(k, v, k_cache, v_cache, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_kernels_capture_in_a_cuda_graph() -> None:
    args = build(CASES[2], device="cuda")["args"]
    k_cache, v_cache = args["k_cache"].clone(), args["v_cache"].clone()
    t, (_, _, heads, dim) = args["q"].shape[0], k_cache.shape
    k = torch.randn(t, heads, dim, device="cuda").to(k_cache.dtype)  # [T, Hkv, D]
    slots = torch.randperm(k_cache.shape[0] * k_cache.shape[1], device="cuda")[:t]
    slots[::3] = -1  # padding rows

    def step() -> torch.Tensor:
        store_kv(k, k, k_cache, v_cache, slots)
        return paged_attention(**{**args, "k_cache": k_cache, "v_cache": v_cache})

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) off the capture
        eager = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

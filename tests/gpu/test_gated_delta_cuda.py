"""GPU-only: the Gated DeltaNet kernels on CUDA tensors against the layer's torch form (run
on the same CUDA tensors): outputs and whole state pools, on the interpreter tests'
randomised batches and on Qwen3.5's head shapes; and a CUDA graph of the kernel path,
replayed after the step's inputs and StateRows tensors change in place, equal to eager.
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from chainspec.models.gated_deltanet import GatedDeltaNet
from chainspec.models.recurrent import PooledStates, StateRows
from tests.unit.kernels.test_gated_delta import (
    SEEDS,
    SHAPES,
    TOL,
    Shape,
    _case,
    _gates,
    next_step,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none visible to torch)")
CUDA = torch.device("cuda")
QWEN = Shape("qwen3_5_hk16_hv32_dk128_dv128", 16, 32, 128, 128, 4)


def _on_cuda(shape: Shape, seed: int):
    layer, x, rows, pools = _case(shape, seed)
    rows = StateRows.build(list(zip(rows.slots, rows.src, rows.keep, strict=True)),
                           rows.spans, CUDA)
    return layer.to(CUDA), x.to(CUDA), rows, tuple(p.to(CUDA) for p in pools)


def _both(layer: GatedDeltaNet, x: torch.Tensor, rows: StateRows, pools):
    with torch.no_grad():
        gates = _gates(layer, x)
        want_pools = tuple(p.clone() for p in pools)
        want = layer._core_reference(PooledStates(want_pools, rows), *gates)
        got = layer._core_kernel(PooledStates(pools, rows), *gates)
    return got, want, want_pools


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [*SHAPES, QWEN], ids=lambda s: s.name)
def test_kernels_match_the_torch_form(shape: Shape, seed: int) -> None:
    layer, x, rows, pools = _on_cuda(shape, seed)
    got, want, want_pools = _both(layer, x, rows, pools)
    tol = TOL[shape.dtype] * (10 if shape is QWEN else 1)  # Dk = 128: longer sums
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for g, w in zip(pools, want_pools, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol)


def test_kernel_path_replays_in_a_cuda_graph() -> None:
    layer, x, rows, pools = _on_cuda(SHAPES[0], 0)
    with torch.no_grad():
        gates = tuple(g.clone() for g in _gates(layer, x))  # static inputs
        access = PooledStates(pools, rows)
        layer._core_kernel(access, *gates)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer._core_kernel(access, *gates)
        # a new step: other inputs, other src rows and keep flags, same spans
        pools2 = _on_cuda(SHAPES[0], 1)[3]
        fresh = next_step(rows, CUDA)
        for static, new in zip(gates, _gates(layer, torch.randn_like(x)), strict=True):
            static.copy_(new)
        for name in ("seq_starts", "slot_ids", "src_rows", "keep_flags"):
            getattr(rows, name).copy_(getattr(fresh, name))
        for p, q in zip(pools, pools2, strict=True):
            p.copy_(q)
        want_pools = tuple(p.clone() for p in pools)
        want = layer._core_reference(PooledStates(want_pools, fresh), *gates)
        graph.replay()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    for g, w in zip(pools, want_pools, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)

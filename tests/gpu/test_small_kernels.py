"""GPU-only: the small Triton kernels on CUDA tensors against their torch references (run
on the same CUDA tensors): acceptance equal exactly, hidden quantization bit for bit
(bf16 outputs too: the GPU rounds to nearest even), MTP input fusion within one output
rounding. The same cases run under the interpreter in tests/unit/kernels. Skipped
without a GPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from chainspec.engine import acceptance as rules
from chainspec.kernels import acceptance as kernels
from chainspec.kernels import hidden_quant as hq
from chainspec.kernels.mtp_input import fused_mtp_input, fused_mtp_input_reference
from tests.unit.kernels.test_acceptance_kernel import _greedy_case, _sampled_case
from tests.unit.kernels.test_hidden_quant import _rows
from tests.unit.kernels.test_mtp_input import _case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none visible to torch)")
CUDA = torch.device("cuda")


def _cuda(args):
    return tuple(a.to(CUDA) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("k", range(0, 5))
@pytest.mark.parametrize("v", (37, 1500, 152064))
def test_greedy_acceptance(k: int, v: int) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        args = _cuda(_greedy_case(100 * k + v, 16, k, v, dtype))
        got, want = kernels.accept_greedy(*args), rules.accept_greedy_reference(*args)
        assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), (dtype,)


@pytest.mark.parametrize("k", range(0, 5))
@pytest.mark.parametrize("v", (37, 1500, 32000))
@pytest.mark.parametrize("top", (None, 1, 3, 8))
def test_sampled_acceptance(k: int, v: int, top: int | None) -> None:
    args = _cuda(_sampled_case(1000 * k + v + (top or 0), 64, k, v, top))
    got, want = kernels.accept_sampled(*args), rules.accept_sampled_reference(*args)
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True))


@pytest.mark.parametrize("qdtype", (torch.int8, torch.float8_e4m3fn))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
@pytest.mark.parametrize("shape", ((1, 1), (9, 200), (64, 7168), (3, 9000)))
def test_hidden_quant_bit_exact(qdtype, dtype, shape) -> None:
    x = _rows(dtype, *shape).to(CUDA)
    q, scale = hq.quantize_rows(x, qdtype)
    rq, rscale = hq.quantize_rows_reference(x, qdtype)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(scale, rscale)
    for out in (torch.float32, dtype):
        assert torch.equal(hq.dequantize_rows(q, scale, out),
                           hq.dequantize_rows_reference(q, scale, out))


# two roundings to the output dtype (normalized row, then times the weight)
RTOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -6}


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16))
def test_mtp_input_fusion(dtype) -> None:
    for (t, h), unit_offset, hidden_first in itertools.product(
            ((1, 16), (5, 48), (64, 4096), (7, 7168)), (False, True), (False, True)):
        args = _cuda((*_case(t, h, dtype, unit_offset, seed=t + h), 1e-6, unit_offset,
                      hidden_first))
        with torch.inference_mode():
            got, want = fused_mtp_input(*args), fused_mtp_input_reference(*args)
        torch.testing.assert_close(got.float(), want.float(), rtol=RTOL[dtype], atol=1e-6)

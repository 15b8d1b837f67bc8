"""Hidden-state quantization: the torch reference keeps its error bounds, and the Triton
kernels (interpreted) reproduce the reference bit for bit: codes, scales and decoded
values, for fp32/fp16/bf16 rows of widely different magnitudes."""

from __future__ import annotations

import pytest
import torch

from chainspec.kernels import hidden_quant as hq
from tests.unit.kernels.interpreted import assert_kernel_equal, interpreted_results

QDTYPES = (torch.int8, torch.float8_e4m3fn)


def _rows(dtype: torch.dtype = torch.float32, t: int = 9, h: int = 200) -> torch.Tensor:
    g = torch.Generator().manual_seed(t * 1000 + h)
    x = torch.randn(t, h, generator=g) * torch.logspace(-6, 3, t)[:, None]  # [T, H]
    if t >= 3 and h >= 4:
        x[1] = 0.0  # an all-zero row
        x[2, :4] = torch.tensor([-0.0, 1e-30, -1e-30, 0.0])
    return x.to(dtype)


def _round_trip(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = hq.quantize_rows(x, qdtype)
    return hq.dequantize_rows(q, scale, torch.float32), scale


# ---------------------------------------------------------------- reference properties
# Each runs here on the torch path and again, in the interpreter, on the kernels.


def check_int8_error_is_at_most_half_a_step() -> None:
    x = _rows()
    y, scale = _round_trip(x, torch.int8)
    assert torch.isfinite(y).all()
    err = (y - x).abs()  # [T, H]
    assert (err <= scale[:, None] * 0.5 * (1 + 1e-5) + 1e-30).all()
    assert scale[1] == 0 and (y[1] == 0).all()


def check_fp8_error_is_relative() -> None:
    x = _rows()
    y, scale = _round_trip(x, torch.float8_e4m3fn)
    # e4m3: 3 mantissa bits -> relative error <= 2**-4 for normals; below the smallest
    # normal (2**-6 * scale) the absolute step is 2**-9 * scale.
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale[:, None] * 2.0 ** -10)
    assert ((y - x).abs() <= bound * (1 + 1e-5)).all()
    assert (y.abs().amax(dim=1) == x.abs().amax(dim=1)).all()  # absmax maps to 448 exactly


def check_codes_use_the_full_range() -> None:
    x = torch.tensor([[-2.0, 1.0, 0.5], [3.0, -0.75, 0.0]])
    q, scale = hq.quantize_rows(x, torch.int8)
    assert q.tolist() == [[-127, 64, 32], [127, -32, 0]]  # 63.5 and 31.75 round half-even
    assert torch.equal(scale, torch.tensor([2 / 127, 3 / 127]))
    q8, _ = hq.quantize_rows(x, torch.float8_e4m3fn)
    assert q8.float()[:, 0].tolist() == [-448.0, 448.0]


def check_nonfinite_rows_get_a_nonfinite_scale() -> None:
    x = torch.randn(3, 40)
    x[0, 3], x[1, 7] = float("nan"), float("-inf")
    for qdtype in QDTYPES:
        _, scale = hq.quantize_rows(x, qdtype)
        assert not torch.isfinite(scale[:2]).any() and torch.isfinite(scale[2])


def check_every_fp8_code_decodes_like_torch() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = codes.view(2, 128)
    got = hq.dequantize_rows(codes, torch.tensor([1.0, 0.5]))
    want = hq.dequantize_rows_reference(codes, torch.tensor([1.0, 0.5]))
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got.signbit(), want.signbit())


# ---------------------------------------------------------------- kernel == reference


def check_kernel_is_bit_exact() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for t, h in ((1, 1), (5, 37), (9, 200), (3, 4100)):  # 4100: two column blocks
            x = _rows(dtype, t, h)
            x = x[:, : h - 1] if h > 1 else x  # a strided view
            for qdtype in QDTYPES:
                q, scale = hq.quantize_rows(x, qdtype)
                rq, rscale = hq.quantize_rows_reference(x, qdtype)
                assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (dtype, t, h)
                assert torch.equal(scale, rscale)
                for out in (torch.float32, dtype):
                    assert_kernel_equal(hq.dequantize_rows(q, scale, out),
                                        hq.dequantize_rows_reference(q, scale, out))


def check_fp8_rounds_half_to_even_at_every_binade() -> None:
    # every e4m3 value and every midpoint between neighbours, scaled so absmax = 448
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    grid = values.float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values  # [127]
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, -grid, -mids])[None, :]  # [1, W]
    q, scale = hq.quantize_rows(x, torch.float8_e4m3fn)
    assert scale.item() == 1.0
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


# ---------------------------------------------------------------- pytest entry points

CHECKS = sorted(n for n in globals() if n.startswith("check_"))
interpreted = interpreted_results(__name__)


@pytest.mark.parametrize("name", CHECKS)
def test_reference(name: str) -> None:
    """The torch path (what CPU serving runs) has each property."""
    globals()[name]()


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_in_interpreter(name: str, interpreted: dict[str, str]) -> None:
    """The same checks on the Triton kernels, run by Triton's interpreter."""
    assert interpreted[name] == "", interpreted[name]


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="qdtype"):
        hq.quantize_rows(torch.zeros(2, 3), torch.float16)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        hq.quantize_rows(torch.zeros(3))
    with pytest.raises(ValueError, match="scale"):
        hq.dequantize_rows(torch.zeros(2, 3, dtype=torch.int8), torch.zeros(3))

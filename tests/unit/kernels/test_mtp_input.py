"""MTP input fusion: the reference is exactly what MTPModule computed with its two RMSNorm
modules and a concat (bit for bit, every family's glue), and the Triton kernel
(interpreted) matches it within one rounding of the output dtype."""

from __future__ import annotations

import itertools

import pytest
import torch

from chainspec.kernels.mtp_input import fused_mtp_input, fused_mtp_input_reference
from chainspec.models.layers import RMSNorm
from tests.unit.kernels.interpreted import interpreted_results

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# one output rounding (plus fp32 statistics in another summation order); bf16 two: the
# interpreter truncates fp32 -> bf16 (see interpreted.assert_kernel_equal) at both roundings
RTOL = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -6}


def _case(t: int, h: int, dtype: torch.dtype, unit_offset: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    emb = (torch.randn(t, h, generator=g) * 0.02).to(dtype)  # [T, H], embedding scale
    hidden = (torch.randn(t, h, generator=g) * 7.0).to(dtype)  # [T, H]
    base = 0.0 if unit_offset else 1.0
    w_e = (base + 0.3 * torch.randn(h, generator=g)).to(dtype)  # [H]
    w_h = (base + 0.3 * torch.randn(h, generator=g)).to(dtype)
    return emb, hidden, w_e, w_h


def _modules_path(emb, hidden, w_e, w_h, eps, unit_offset, hidden_first) -> torch.Tensor:
    """What MTPModule.forward computed before the fusion: two RMSNorm modules + concat."""
    h = emb.shape[-1]
    enorm, hnorm = RMSNorm(h, eps, unit_offset), RMSNorm(h, eps, unit_offset)
    with torch.no_grad():
        enorm.weight.data, hnorm.weight.data = w_e.clone(), w_h.clone()
        e, g = enorm(emb), hnorm(hidden)
    return torch.cat([g, e] if hidden_first else [e, g], dim=-1)


def test_reference_is_the_modules_path_bit_for_bit() -> None:
    for dtype, unit_offset, hidden_first in itertools.product(DTYPES, (False, True),
                                                              (False, True)):
        args = (*_case(3, 24, dtype, unit_offset), 1e-6, unit_offset, hidden_first)
        want = _modules_path(*args)
        got = fused_mtp_input_reference(*args)
        assert got.dtype == want.dtype and torch.equal(got, want), (dtype, unit_offset)


def test_cpu_dispatch_takes_the_reference() -> None:
    args = (*_case(2, 16, torch.float32, False), 1e-6, False, True)
    assert torch.equal(fused_mtp_input(*args), fused_mtp_input_reference(*args))


def check_kernel_matches_reference() -> None:
    shapes = ((1, 16), (5, 48), (4, 200))  # 48, 200: not powers of two (masked lanes)
    for (t, h), dtype, unit_offset, hidden_first in itertools.product(
            shapes, DTYPES, (False, True), (False, True)):
        args = (*_case(t, h, dtype, unit_offset, seed=t + h), 1e-5, unit_offset, hidden_first)
        got, want = fused_mtp_input(*args), fused_mtp_input_reference(*args)
        assert got.dtype == want.dtype and got.shape == (t, 2 * h)
        torch.testing.assert_close(got.float(), want.float(), rtol=RTOL[dtype], atol=1e-6,
                                   msg=lambda m, a=(t, h, dtype, unit_offset): f"{a}: {m}")


def check_strided_rows_and_zero_rows() -> None:
    emb, hidden, w_e, w_h = _case(6, 32, torch.float32, False)
    emb, hidden = emb[::2], torch.cat([hidden, hidden], dim=1)[::2, :32]  # strided views
    hidden[1] = 0.0  # a zero row normalizes to zero (eps), never NaN
    got = fused_mtp_input(emb, hidden, w_e, w_h, 1e-6, False, False)
    want = fused_mtp_input_reference(emb, hidden, w_e, w_h, 1e-6, False, False)
    assert torch.isfinite(got).all() and (got[1, 32:] == 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def check_training_keeps_the_autograd_path() -> None:
    emb, hidden, w_e, w_h = _case(2, 16, torch.float32, False)
    w_e.requires_grad_(True)
    fused_mtp_input(emb, hidden, w_e, w_h, 1e-6, False, False).sum().backward()
    assert w_e.grad is not None  # the kernel has no backward; the reference ran


interpreted = interpreted_results(__name__)
CHECKS = sorted(n for n in globals() if n.startswith("check_"))


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_in_interpreter(name: str, interpreted: dict[str, str]) -> None:
    assert interpreted[name] == "", interpreted[name]

"""Batched acceptance kernels (interpreted) against the torch rules of engine/acceptance.py:
the same accepted_len and next token, exactly, on randomised batches that mix every case
the rules distinguish (K = 0..4, num_drafts < K, unusable drafts, ties in the target
argmax, point-mass and top-k q with duplicate and out-of-range support entries)."""

from __future__ import annotations

import os

import pytest
import torch

from chainspec.engine import acceptance as rules
from chainspec.kernels import acceptance as kernels
from tests.unit.kernels.interpreted import interpreted_results

VOCABS = (37, 1500)  # 1500: several vocab blocks of 512
if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter run of the check_* below
    kernels.BLOCK_V = 512


def _drafts(g: torch.Generator, top: torch.Tensor, k: int, v: int) -> torch.Tensor:
    """Mostly the target's own choice (so runs get accepted), some wrong, some invalid."""
    b = top.shape[0]
    drafts = top[:, :k].clone()  # [B, K]
    wrong = torch.rand(b, k, generator=g) < 0.25
    drafts[wrong] = torch.randint(0, v, (int(wrong.sum()),), generator=g)
    bad = torch.rand(b, k, generator=g) < 0.05
    drafts[bad] = torch.tensor([-1, v, v + 7])[torch.randint(0, 3, (int(bad.sum()),),
                                                             generator=g)]
    return drafts


def _greedy_case(seed: int, b: int, k: int, v: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    # small integers: many exact ties, which argmax breaks by first index
    logits = torch.randint(-3, 4, (b, k + 1, v), generator=g).to(dtype)  # [B, K+1, V]
    logits[0, :, v - 1] = 9  # a winner in the last block
    logits[1 % b, :, [3, v - 2]] = 9  # a tie across blocks: the first must win
    drafts = _drafts(g, logits.float().argmax(-1), k, v)
    num_drafts = torch.randint(0, k + 1, (b,), generator=g)
    return logits, drafts, num_drafts


def check_greedy_matches_reference_exactly() -> None:
    for k in range(0, 5):
        for v in VOCABS:
            for dtype in (torch.float32, torch.bfloat16) if v > 1000 else (
                    torch.float32, torch.float16, torch.bfloat16):
                args = _greedy_case(100 * k + v, 8, k, v, dtype)
                got = kernels.accept_greedy(*args)
                want = rules.accept_greedy_reference(*args)
                assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), (
                    k, v, dtype, got, want)
                assert got[0].dtype == got[1].dtype == torch.int64


def _sampled_case(seed: int, b: int, k: int, v: int, top: int | None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, v, generator=g) * 2.0
    logits[:, :, : v // 3] -= 1e4  # tokens with p = 0 (as top-k/top-p leave them)
    probs = torch.softmax(logits, dim=-1)  # [B, K+1, V]
    drafts = _drafts(g, probs.argmax(-1), k, v)
    num_drafts = torch.randint(0, k + 1, (b,), generator=g)
    support = q = None
    if top is not None:
        support = torch.randint(0, v, (b, k, top), generator=g)  # [B, K, top]
        support[..., 0] = drafts  # usually the draft is in its support ...
        support[torch.rand(b, k, generator=g) < 0.1, 0] = 0  # ... not always (q(d) = 0)
        support[..., -1] = torch.where(torch.rand(b, k, generator=g) < 0.3,
                                       support[..., 0], support[..., -1])  # duplicates
        support[torch.rand(b, k, top, generator=g) < 0.05] = v + 3  # out of range
        q = torch.softmax(torch.randn(b, k, top, generator=g) * 2, dim=-1)
    accept_u = torch.rand(b, k, generator=g).clamp_min(2.0 ** -24)
    noise = -torch.rand(b, v, generator=g).clamp_min(2.0 ** -24).log()  # Exp(1) [B, V]
    return probs, drafts, support, q, num_drafts, accept_u, noise


def check_sampled_matches_reference_exactly() -> None:
    for k in range(0, 5):
        for v in VOCABS:
            for top in (None, 1, 3, 8) if v < 1000 else (None, 3):
                args = _sampled_case(1000 * k + v + (top or 0), 8, k, v, top)
                got = kernels.accept_sampled(*args)
                want = rules.accept_sampled_reference(*args)
                assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True)), (
                    k, v, top, got, want)


def check_sampled_cases_are_all_exercised() -> None:
    """The random batches above reach every branch: full acceptance, a rejection with a
    residual draw, and unusable drafts."""
    probs, drafts, support, q, nd, u, noise = _sampled_case(0, 32, 4, 37, 3)
    acc, _ = kernels.accept_sampled(probs, drafts, support, q, nd, u, noise)
    assert (acc == nd).any() and (acc < nd).any() and (acc == 4).any()


def check_half_precision_draft_probs() -> None:
    probs, drafts, support, q, nd, u, noise = _sampled_case(11, 16, 3, 37, 4)
    args = (probs, drafts, support, q.to(torch.bfloat16), nd, u, noise)
    got, want = kernels.accept_sampled(*args), rules.accept_sampled_reference(*args)
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True))


interpreted = interpreted_results(__name__)
CHECKS = sorted(n for n in globals() if n.startswith("check_"))


@pytest.mark.parametrize("name", CHECKS)
def test_kernel_in_interpreter(name: str, interpreted: dict[str, str]) -> None:
    assert interpreted[name] == "", interpreted[name]


def test_cpu_tensors_take_the_reference() -> None:
    """Outside kernels_on_cpu(), serving on CPU runs the torch rules."""
    args = _sampled_case(3, 8, 2, 37, 3)
    got, want = rules.accept_sampled(*args), rules.accept_sampled_reference(*args)
    assert all(torch.equal(a, w) for a, w in zip(got, want, strict=True))

"""Timings of the small kernels against their torch references, for `make gpu-check`
(benchmarks/gpu/small_kernels.py calls every `bench_*` here). Each returns one row per
shape: {"shape", "kernel_ms", "reference_ms", "speedup"}. On CUDA the times are
`triton.testing.do_bench` medians; with `tiny` (a CPU dry run inside kernels_on_cpu())
the shapes shrink and the host clock times a few calls: a smoke test, not a number.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from chainspec.engine import acceptance as rules
from chainspec.kernels import hidden_quant, mtp_input


def bench_acceptance_greedy(device: torch.device, repeats: int = 10, tiny: bool = False
                            ) -> list[dict]:
    """Greedy acceptance over bf16 logits [B, K+1, V] (V = 152k, Qwen-sized)."""
    rows = []
    for b, k, v in ((1, 3, 2000), (8, 4, 3000)) if tiny else (
            (1, 3, 152064), (8, 3, 152064), (64, 4, 152064)):
        logits = torch.randn(b, k + 1, v, device=device, dtype=torch.bfloat16)
        drafts = logits[:, :k].float().argmax(-1)  # [B, K]: all accepted, the longest path
        nd = torch.full((b,), k, device=device)
        args = (logits, drafts, nd)
        rows.append(_compare((b, k, v), repeats, tiny, lambda a=args: rules.accept_greedy(*a),
                             lambda a=args: rules.accept_greedy_reference(*a)))
    return rows


def bench_acceptance_sampled(device: torch.device, repeats: int = 10, tiny: bool = False
                             ) -> list[dict]:
    """Sampled acceptance with top-8 draft distributions; one rejection per row."""
    rows = []
    for b, k, v in ((2, 3, 2000),) if tiny else ((1, 3, 152064), (8, 3, 152064),
                                                  (64, 4, 152064)):
        g = torch.Generator(device=device).manual_seed(0)
        p = torch.softmax(torch.randn(b, k + 1, v, device=device, generator=g), -1)
        support = torch.randint(0, v, (b, k, 8), device=device, generator=g)
        q = torch.softmax(torch.randn(b, k, 8, device=device, generator=g), -1)
        drafts = support[..., 0]  # [B, K]
        nd = torch.full((b,), k, device=device)
        u = torch.rand(b, k, device=device, generator=g)
        noise = -torch.rand(b, v, device=device, generator=g).log()
        args = (p, drafts, support, q, nd, u, noise)
        rows.append(_compare((b, k, v), repeats, tiny, lambda a=args: rules.accept_sampled(*a),
                             lambda a=args: rules.accept_sampled_reference(*a)))
    return rows


def bench_hidden_quant(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                       repeats: int = 10, tiny: bool = False) -> list[dict]:
    """int8 quantize + dequantize of hidden rows [T, H] (a round's update, prefill)."""
    rows = []
    for t, h in ((4, 64),) if tiny else ((8, 4096), (64, 7168), (4096, 7168)):
        x = torch.randn(t, h, device=device, dtype=dtype)

        def kernel(x=x):
            return hidden_quant.dequantize_rows(*hidden_quant.quantize_rows(x), dtype)

        def reference(x=x):
            q, s = hidden_quant.quantize_rows_reference(x)
            return hidden_quant.dequantize_rows_reference(q, s, dtype)

        rows.append(_compare((t, h), repeats, tiny, kernel, reference))
    return rows


def bench_mtp_input(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                    repeats: int = 10, tiny: bool = False) -> list[dict]:
    """enorm + hnorm + concat for [T, H] rows: draft windows (T <= 2K per sequence x B)
    and a prefill chunk."""
    rows = []
    for t, h in ((4, 64),) if tiny else ((8, 4096), (64, 7168), (2048, 7168)):
        emb, hid = (torch.randn(t, h, device=device, dtype=dtype) for _ in range(2))
        w_e, w_h = (torch.ones(h, device=device, dtype=dtype) for _ in range(2))
        args = (emb, hid, w_e, w_h, 1e-6, False, False)
        rows.append(_compare((t, h), repeats, tiny,
                             lambda a=args: mtp_input.fused_mtp_input(*a),
                             lambda a=args: mtp_input.fused_mtp_input_reference(*a)))
    return rows


def _compare(shape: tuple, repeats: int, tiny: bool, kernel: Callable[[], object],
             reference: Callable[[], object]) -> dict:
    k_ms, r_ms = _time(kernel, repeats, tiny), _time(reference, repeats, tiny)
    return {"shape": list(shape), "kernel_ms": k_ms, "reference_ms": r_ms,
            "speedup": r_ms / k_ms if k_ms > 0 else None}


def _time(fn: Callable[[], object], repeats: int, tiny: bool) -> float:
    if not tiny and torch.cuda.is_available():
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=max(repeats, 10),
                                             return_mode="median"))
    fn()
    times = []
    for _ in range(max(1, min(repeats, 3))):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)

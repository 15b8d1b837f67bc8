"""Small kernels (acceptance, hidden quantization, MTP input fusion) against their torch
references, through the timing functions `chainspec.kernels.bench` provides."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect

import torch

from benchmarks.gpu.timing import Budget, Context, each_size, skipped
from chainspec.kernels.triton_support import kernels_on_cpu

BENCH = "chainspec.kernels.bench"


def small_kernels_section(ctx: Context, budget: Budget) -> dict:
    if importlib.util.find_spec(BENCH) is None:
        return skipped(f"{BENCH} is not on main yet")
    mod = importlib.import_module(BENCH)
    benches = [(n, f) for n, f in inspect.getmembers(mod, inspect.isfunction)
               if n.startswith("bench_") and f.__module__ == BENCH]
    if not benches:
        return skipped(f"{BENCH} has no bench_* functions")

    def measure(item) -> dict:
        name, fn = item
        kwargs = _kwargs(fn, ctx)
        result = fn(**kwargs)
        rows = result if isinstance(result, list) else [result]
        return {"bench": name, "results": rows}

    on_cpu = kernels_on_cpu() if ctx.dry_run else contextlib.nullcontext()
    with on_cpu, torch.inference_mode():
        out = each_size(benches, budget, measure)
    # one flat table: a row per result, named by its bench
    out["rows"] = [{"bench": r["bench"], **res} for r in out["rows"] for res in r["results"]]
    return out


def _kwargs(fn, ctx: Context) -> dict:
    """Pass the run's device, dtype, repeats and dry-run flag to whichever a bench takes."""
    offered = {"device": ctx.device, "dtype": ctx.dtype, "repeats": ctx.repeats,
               "tiny": ctx.dry_run, "dry_run": ctx.dry_run}
    params = inspect.signature(fn).parameters
    return {k: v for k, v in offered.items() if k in params}

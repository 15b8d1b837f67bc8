"""Timing for the GPU check: medians of CUDA-event times (host clock on CPU), a time
budget per section, and the run context every section receives."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Context:
    """What every section is told: where to run and how hard to try."""

    device: torch.device
    dtype: torch.dtype
    dry_run: bool  # CPU, tiny shapes: exercise the code paths, not a measurement
    repeats: int = 10
    warmup: int = 3


def median_ms(fn: Callable[[], object], ctx: Context) -> float:
    """Median wall time of one call in ms, each call started from an idle device.

    CUDA: events around the call (covers host launch time when the GPU waits on it);
    elsewhere the host clock."""
    for _ in range(ctx.warmup):
        fn()
    if ctx.device.type != "cuda":
        times = []
        for _ in range(ctx.repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    pairs = []
    for _ in range(ctx.repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


class Budget:
    """Seconds a section may spend; sizes past it are skipped and recorded as such."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    @property
    def spent(self) -> bool:
        return time.monotonic() - self.start > self.seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def each_size(sizes: Sequence, budget: Budget, measure: Callable[[object], dict]) -> dict:
    """`{"rows": [measure(size), ...]}` over `sizes`, stopping when `budget` is spent;
    the sizes left out are listed under "skipped_sizes"."""
    rows = []
    for i, size in enumerate(sizes):
        if budget.spent:
            return {"rows": rows, "budget_s": budget.seconds,
                    "skipped_sizes": [str(s) for s in sizes[i:]]}
        rows.append(measure(size))
    return {"rows": rows}


def skipped(reason: str) -> dict:
    return {"skipped": reason}

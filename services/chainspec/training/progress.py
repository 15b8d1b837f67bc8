"""A one-line progress bar: step, rate, ETA, loss and the per-position greedy acceptance
estimates of the training batches (exponential moving averages)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

SMOOTHING = 0.9


class ProgressBar:
    def __init__(self, total: int, first: int = 0, stream: TextIO | None = None,
                 width: int = 24) -> None:
        self.total, self.first, self.width = total, first, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.ema: dict[str, float] = {}

    def update(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            old = self.ema.get(key, value)
            self.ema[key] = SMOOTHING * old + (1 - SMOOTHING) * value
        # NOTE: off a terminal the stage's log rows already report; print nothing more.
        if self.tty:
            self.stream.write("\r" + self.line(step))
            if step == self.total:
                self.stream.write("\n")
            self.stream.flush()

    def line(self, step: int) -> str:
        done = step / max(self.total, 1)
        filled = int(self.width * done)
        elapsed = time.monotonic() - self.started
        rate = (step - self.first) / max(elapsed, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else 0.0
        soft = [v for k, v in self.ema.items() if k.startswith("distill")]
        loss = sum(soft) / max(len(soft), 1)  # the distill objective
        acc = [self.ema[f"acc{k}"] for k in range(1, len(self.ema) + 1)
               if f"acc{k}" in self.ema]
        accept = " ".join(f"{a:.2f}" for a in acc)
        mean_len = 1 + sum(acc)
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} "
                f"{rate:.2f} it/s eta {eta / 60:.1f}m loss {loss:.3f} "
                f"accept/pos {accept} (len {mean_len:.2f})")

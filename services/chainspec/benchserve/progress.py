"""A one-line progress bar on stderr: redrawn in place on a terminal, one line per point
otherwise (logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from chainspec.benchserve.client import RequestResult

WIDTH = 30


class Progress:
    def __init__(self, label: str, total: int, out: TextIO = sys.stderr) -> None:
        self.label, self.total, self.out = label, total, out
        self.done = self.errors = 0
        self.t0 = time.perf_counter()
        self.live = out.isatty()

    def __call__(self, result: RequestResult) -> None:
        self.done += 1
        self.errors += not result.ok
        if self.live:
            self.out.write("\r" + self.line())
            self.out.flush()

    def line(self) -> str:
        filled = WIDTH * self.done // max(1, self.total)
        return (f"{self.label:<24} [{'#' * filled}{'.' * (WIDTH - filled)}] "
                f"{self.done}/{self.total}  errors {self.errors}  "
                f"{time.perf_counter() - self.t0:6.1f} s")

    def close(self) -> None:
        self.out.write(("\r" if self.live else "") + self.line() + "\n")
        self.out.flush()

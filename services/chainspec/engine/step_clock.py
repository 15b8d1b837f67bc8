"""Timing the chained steps of one draft round without adding a host sync."""

from __future__ import annotations

import itertools
import time

import torch


class StepClock:
    """`mark()` at the start of a round and after each step; `durations()` once the
    round's outputs are on the host. On CPU marks are `perf_counter` readings; on CUDA
    they are timing events on the current stream, which are complete by then, so reading
    them waits for nothing. A replayed CUDA graph never calls `mark` (nothing per step)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list = []

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def durations(self) -> tuple[float, ...]:
        """Seconds between consecutive marks (one per step); () when not marked."""
        marks = self._marks
        if len(marks) < 2:
            return ()
        if self._cuda:
            # NOTE: the outputs were copied to the host after the last mark: no wait here
            marks[-1].synchronize()
            return tuple(a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks))
        return tuple(b - a for a, b in itertools.pairwise(marks))

"""Opt-in timestamps of a Draft round's hops, for `benchmarks/round_breakdown.py`.

Each side marks (batch_id, hop, time.monotonic_ns()) at fixed points of a round. On
Linux `time.monotonic_ns()` reads CLOCK_MONOTONIC, one clock for every process on a
host, so marks of the verifier and of a drafter on the same machine can be subtracted.
Off (the default: no `RoundTrace` object) it costs one `is None` test per hop.
"""

from __future__ import annotations

import collections
import time


class RoundTrace:
    """A bounded ring of (batch_id, hop, t_ns); `mark` is thread-safe (deque.append)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.marks: collections.deque[tuple[int, str, int]] = collections.deque(
            maxlen=capacity)

    def mark(self, batch_id: int, hop: str) -> None:
        self.marks.append((batch_id, hop, time.monotonic_ns()))

    def drain(self) -> list[tuple[int, str, int]]:
        """Every mark so far, oldest first; the ring is then empty."""
        out = []
        while self.marks:
            out.append(self.marks.popleft())
        return out

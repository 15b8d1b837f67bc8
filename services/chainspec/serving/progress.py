"""What `chainspec serve` shows while the stack starts: timed steps, and the members'
states while they load their models and warm up (one line redrawn on a terminal, a
line per change otherwise)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import TextIO

POLL_S = 0.5


class Progress:
    def __init__(self, out: TextIO | None = None, quiet: bool = False) -> None:
        self.out = out or sys.stdout
        self.quiet = quiet
        self.tty = self.out.isatty()
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._live = False  # a redrawn line is on screen

    def step(self, text: str) -> None:
        with self._lock:
            self._write(f"[{time.monotonic() - self.t0:5.1f}s] {text}", final=True)

    def live(self, text: str) -> None:
        """A line that the next one replaces on a terminal; printed on change elsewhere."""
        with self._lock:
            self._write(f"[{time.monotonic() - self.t0:5.1f}s] {text}", final=False)

    def _write(self, line: str, final: bool) -> None:
        if self.quiet:
            return
        if self.tty:
            self.out.write("\r\033[K" + line + ("\n" if final else ""))
            self._live = not final
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def end_live(self) -> None:
        with self._lock:
            if self._live:
                self.out.write("\n")
                self.out.flush()
                self._live = False

    @contextlib.contextmanager
    def members(self, namespace: str, label: str):
        """While the block runs, show the stack's members and their states."""
        stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(namespace, label, stop),
                                  daemon=True, name="serve-progress")
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)
            self.end_live()

    def _watch(self, namespace: str, label: str, stop: threading.Event) -> None:
        last = None
        while not stop.wait(POLL_S):
            summary = _member_summary(namespace)
            if summary is None:
                continue
            if self.tty or summary != last:
                self.live(f"{label}: {summary}")
                last = summary


def _member_summary(namespace: str) -> str | None:
    """"verifier-0 starting, drafter-0 ready", or None before the controller exists."""
    import ray

    from chainspec.cluster.config import CONTROLLER_NAME

    if not ray.is_initialized():
        return None
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
        members = ray.get(controller.members.remote(), timeout=2.0)
    except Exception:  # not created yet, or busy: try again at the next poll
        return None
    if not members:
        return "starting the controller"
    return ", ".join(f"{m['member_id']} {m['state']}" for m in members)

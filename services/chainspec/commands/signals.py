"""Wait for SIGINT/SIGTERM, then drain: how every long-running command ends.

`drafter` and `verifier` serve on the main thread's event loop (`serve_until_signal`);
`gateway`, `up` and `serve` run their work elsewhere and block the main thread
(`until_stopped`). Both wait on one `StopSignal`: the first SIGINT/SIGTERM, a failure the
service reports (`fail`: exit 1, so a supervisor restarts it) or what it fronts going away
(`lost`) gives the reason; the command then drains and exits.

Signal handlers are installed when the wait starts, not before: a signal while a model
loads still ends the process at once (the default action), with nothing to drain.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOST = "stopped from elsewhere"
POLL_S = 0.2  # how often a blocked main thread looks at `lost`


class StopSignal:
    """Why a command stops; the first reason wins."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.failed = False
        self._wake: Callable[[], None] = lambda: None

    def stop(self, reason: str, failed: bool = False) -> None:
        # NOTE: runs in signal handlers and on other threads: no locks, no blocking
        if self.reason is None:
            self.reason, self.failed = reason, failed
        self._wake()

    def fail(self, reason: str) -> None:
        """The service can no longer serve (its engine died or stalled)."""
        self.stop(reason, failed=True)

    def _on_signal(self, signum: int, _frame=None) -> None:
        self.stop(f"got {signal.Signals(signum).name}")

    def catch(self) -> None:
        """From now on SIGINT/SIGTERM stop this (`wait` calls it; call it earlier to
        catch signals sooner)."""
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)

    def wait(self, lost: threading.Event | None = None) -> str:
        """Block the main thread until a signal, `fail`, or `lost` being set."""
        self.catch()
        while self.reason is None:
            if lost is not None and lost.is_set():
                self.stop(LOST)
                break
            time.sleep(POLL_S)  # NOTE: a handler runs at once; the loop sees it within POLL_S
        return self.reason

    async def wait_async(self) -> str:
        """Wait on the running loop (the main thread's) until a signal or `fail`."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        # NOTE: before looking at `reason`, so a stop from another thread in between wakes us
        self._wake = lambda: loop.call_soon_threadsafe(woken.set)
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        if self.reason is None:
            await woken.wait()
        return self.reason


def until_stopped(drain: Callable[[str], object], lost: threading.Event | None = None,
                  stop: StopSignal | None = None) -> int:
    """Block until SIGINT/SIGTERM (or `lost`, or `stop.fail`), then `drain(reason)`; exit
    code 0, or 1 after a failure. `drain` runs even if the wait is interrupted (Ctrl-C
    before the handlers are in), so what the command started is always stopped."""
    stop = stop or StopSignal()
    reason = "interrupted"
    try:
        reason = stop.wait(lost)
    finally:
        drain(reason)
    return 1 if stop.failed else 0


async def serve_until_signal(role: str, drain: Callable[[], Awaitable[None]],
                             stop: StopSignal | None = None) -> int:
    """Serve until SIGTERM or SIGINT (exit 0) or until `stop.fail(reason)` (the service can
    no longer serve: exit 1, so a supervisor restarts it); drain either way."""
    stop = stop or StopSignal()
    await stop.wait_async()
    if stop.failed:
        print(f"{role} failed: {stop.reason}", file=sys.stderr, flush=True)
    print(f"{role} draining", flush=True)
    await drain()
    print(f"{role} stopped", flush=True)
    return 1 if stop.failed else 0

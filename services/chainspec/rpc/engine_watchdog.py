"""Health that tells the truth about a verifier's engine thread (DESIGN 4.4).

The gRPC process can outlive its engine: a thread that died (an engine bug) or is stuck
in one step serves nothing while the port still answers. The watchdog hears a death at
once (`AsyncVerifier.on_failure`) and polls for a stall; either way it turns health
NOT_SERVING and calls the host's `on_failure(reason)` once, so the host can report the
reason and exit (a Ray actor is then restarted; a service command exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from chainspec.engine.async_engine import AsyncVerifier
from chainspec.rpc.server import RunningServer

log = logging.getLogger(__name__)


class EngineWatchdog:
    def __init__(self, engine: AsyncVerifier, running: RunningServer, stall_limit_s: float,
                 on_failure: Callable[[str], None] | None = None,
                 interval_s: float = 0.25) -> None:
        if stall_limit_s <= 0 or interval_s <= 0:
            raise ValueError("stall_limit_s and interval_s must be > 0")
        self.engine, self.running = engine, running
        self.stall_limit_s, self.interval_s = stall_limit_s, interval_s
        self.on_failure = on_failure
        self.failure: str | None = None  # why the engine is out of service, once it is
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Begin watching (inside the server's event loop)."""
        loop = asyncio.get_running_loop()

        def heard(reason: str) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(self.fail, reason)
            except RuntimeError:
                pass  # the loop is gone: so is the server
        self.engine.on_failure(heard)
        self._task = loop.create_task(self._poll())
        self.running.add_stop_hook(self._task.cancel)

    def fail(self, reason: str) -> None:
        """Take the engine out of service (idempotent): NOT_SERVING, then tell the host."""
        if self.failure is not None:
            return
        self.failure = reason
        log.error("verifier engine out of service: %s", reason)
        asyncio.get_running_loop().create_task(self.running.set_serving(False))
        if self.on_failure is not None:
            self.on_failure(reason)

    async def _poll(self) -> None:
        while self.failure is None:
            reason = self.engine.failure or self.engine.stalled(self.stall_limit_s)
            if reason is not None:
                self.fail(reason)
                return
            await asyncio.sleep(self.interval_s)

"""Where the gateway learns its verifiers: a static list, or the controller's membership
when the stack runs on Ray (DESIGN 4.4). A source's `run(pool)` keeps the pool's
endpoints current until cancelled."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 10.0


class StaticVerifiers:
    """A fixed list of `host:port` endpoints (`chainspec gateway --verifier ...`)."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        for ep in endpoints:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"verifier endpoint {ep!r}: expected HOST:PORT")
        self.endpoints = tuple(endpoints)

    async def run(self, pool) -> None:
        pool.set_endpoints(self.endpoints)


class ControllerVerifiers:
    """The ready verifiers of a Ray-hosted stack, long-polled from its controller.
    `on_lost` is called once if the controller dies for good (the stack was stopped)."""

    def __init__(self, controller, on_lost: Callable[[], None] | None = None) -> None:
        self.controller, self.on_lost = controller, on_lost

    async def run(self, pool) -> None:
        from ray.exceptions import ActorDiedError

        version = -1
        while True:
            try:
                version, members = await self.controller.watch.remote(version, WATCH_TIMEOUT_S)
            except ActorDiedError:
                log.warning("the stack's controller is gone; no verifiers to route to")
                pool.set_endpoints(())
                if self.on_lost is not None:
                    self.on_lost()
                return
            except Exception as e:  # restarting controller, transient Ray errors
                log.warning("membership watch failed (%s); retrying", e)
                await asyncio.sleep(1.0)
                continue
            pool.set_endpoints(m["endpoint"] for m in members
                               if m["role"] == "verifier" and m["state"] == "ready"
                               and m["endpoint"])

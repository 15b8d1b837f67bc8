"""Where the gateway learns its verifiers: a static list, or the controller's membership
when the stack runs on Ray (DESIGN 4.4). A source's `run(pool, describe)` keeps the
pool's endpoints current until cancelled; `describe()` is this gateway's member info
(endpoint, load, serving, pid, metrics_url), which the Ray source registers with the
controller as a `gateway` member."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 10.0
LEAVE_TIMEOUT_S = 5.0

Describe = Callable[[], dict[str, Any]]


class StaticVerifiers:
    """A fixed list of `host:port` endpoints (`chainspec gateway --verifier ...`). Its
    only known member is the gateway itself."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        for ep in endpoints:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"verifier endpoint {ep!r}: expected HOST:PORT")
        self.endpoints = tuple(endpoints)
        self._describe: Describe | None = None

    async def run(self, pool, describe: Describe) -> None:
        self._describe = describe
        pool.set_endpoints(self.endpoints)

    def members(self) -> list[dict[str, Any]]:
        if self._describe is None:
            return []
        return [{**self._describe(), "member_id": "gateway", "role": "gateway",
                 "state": "ready"}]


class ControllerVerifiers:
    """The ready verifiers of a Ray-hosted stack, long-polled from its controller; the
    gateway joins the membership (role `gateway`), heartbeats with `register` and leaves
    when stopped. `on_lost` is called once if the controller dies for good (the stack
    was stopped). `rejoin` (a new controller handle from a new Ray session) is called
    when this process's Ray session itself ended, e.g. a Ray Client whose server went
    with a restarted head pod: the gateway joins again instead of routing on a stale
    membership for ever."""

    def __init__(self, controller, on_lost: Callable[[], None] | None = None,
                 rejoin: Callable[[], Any] | None = None) -> None:
        self.controller, self.on_lost, self.rejoin = controller, on_lost, rejoin
        self.member_id: str | None = None
        self._members: list[dict[str, Any]] = []  # as of the last watch

    def members(self) -> list[dict[str, Any]]:
        return list(self._members)

    async def run(self, pool, describe: Describe) -> None:
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(describe))
        try:
            await self._follow(pool)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)
            await self._leave()

    async def _follow(self, pool) -> None:
        from ray.exceptions import ActorDiedError

        version = -1
        while True:
            try:
                version, members = await self.controller.watch.remote(version, WATCH_TIMEOUT_S)
            except ActorDiedError:
                log.warning("the stack's controller is gone; no verifiers to route to")
                self._members = []
                pool.set_endpoints(())
                if self.on_lost is not None:
                    self.on_lost()
                return
            except Exception as e:  # restarting controller, transient Ray errors
                log.warning("membership watch failed (%s); retrying", e)
                if self.rejoin is not None and _session_ended():
                    await self._rejoin()
                    version = -1
                await asyncio.sleep(1.0)
                continue
            self._members = members
            pool.set_endpoints(m["endpoint"] for m in members
                               if m["role"] == "verifier" and m["state"] == "ready"
                               and m["endpoint"])

    async def _rejoin(self) -> None:
        """A new Ray session and controller handle (the head may still be coming back:
        the next failed watch tries again); the heartbeat joins as a new member."""
        try:
            self.controller = await asyncio.to_thread(self.rejoin)
        except Exception as e:
            log.warning("the Ray session ended; joining the stack again failed (%s)", e)
            return
        log.warning("the Ray session ended; joined the stack again")
        self.member_id = None

    async def _heartbeat(self, describe: Describe) -> None:
        """Join, then `register` often enough that the controller never expires us; a
        restarted controller has forgotten us (`register` is False): join again."""
        import ray

        config = await self.controller.get_config.remote()
        interval = min(1.0, config["health_timeout_s"] / 3)
        node = ray.util.get_node_ip_address()
        while True:
            info = {**describe(), "node": node}
            host, _, port = info["endpoint"].rpartition(":")
            if host in ("0.0.0.0", "::", ""):  # listening everywhere: advertise the node
                info["endpoint"] = f"{node}:{port}"
                info["metrics_url"] = f"http://{node}:{port}/metrics"
            try:
                if self.member_id is None or \
                        not await self.controller.register.remote(self.member_id, info):
                    self.member_id = await self.controller.join.remote("gateway", info)
            except Exception as e:  # the controller restarting or gone; _follow decides
                log.debug("gateway heartbeat failed: %s", e)
            await asyncio.sleep(interval)

    async def _leave(self) -> None:
        if self.member_id is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.controller.leave.remote(self.member_id),
                                   LEAVE_TIMEOUT_S)
        self.member_id = None


def _session_ended() -> bool:
    """This process's Ray session is gone for good (a driver's survives a GCS outage; a
    Ray Client's ends when its server does, after its reconnect grace period)."""
    import ray

    return not ray.is_initialized()

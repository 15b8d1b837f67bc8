"""The Ray actors that host the services (DESIGN 4.4): thin shells around
`serve_drafter` and `serve_verifier`.

Each actor is an asyncio actor: `__init__` schedules the start on the actor's event
loop, so a Ray restart (max_restarts) brings the service back without anyone calling
in. Once started (or failed) the actor registers with the controller; the controller's
pings (`ping`) keep its state and load current. A verifier also long-polls the controller
and points its drafter pool at the ready drafters.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from chainspec.cluster.config import CONTROLLER_NAME, StackConfig
from chainspec.cluster.plain_target import no_mtp_reason
from chainspec.cluster.tp_ranks import hosted_group
from chainspec.engine.factory import TimedDrafterEngine, load_drafter
from chainspec.metrics.drafter import DrafterMetrics
from chainspec.metrics.verifier import VerifierMetrics
from chainspec.models.errors import CheckpointError
from chainspec.models.hub import served_name
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 10.0
FAILED_EXIT_S = 2.0  # a verifier whose engine failed reports it, then exits (Ray restarts it)
REGISTER_TRIES = 20  # ~1 min of backoff; after that the controller's pings must do


class _ServiceActor:
    """A member; at TP = N it is rank 0 of a group whose ranks 1.. are actors it owns in
    its placement group (`cluster/tp_ranks.py`). A dead rank fails the member:
    NOT_SERVING, then the process exits and Ray restarts it, which replaces every rank
    (they die with their owner)."""

    role = ""
    group_failure: str | None = None

    def __init__(self, member_id: str, config: StackConfig) -> None:
        self.member_id, self.config = member_id, config
        self.server: Any = None  # RunningServer | VerifierServer once started
        self.error: str | None = None
        self._start = asyncio.get_running_loop().create_task(self._start_and_register())

    @ray.method(enable_task_events=False)  # several a second for ever: see controller.py
    async def ping(self) -> dict[str, Any]:
        """State for the controller: serving, endpoint, load, pid, node, metrics_url, error,
        `ranks` at TP > 1 (rank, pid, node, state each), a verifier's drafter links
        (endpoint -> live/connecting/dead/...) and its drafter_mode (local: the
        `in-process` link)."""
        ranks = await self._check_ranks()
        node = ray.util.get_node_ip_address()
        failure = getattr(self.server, "failure", None) or self.group_failure
        return {"serving": self.server is not None and not self.server_draining
                and failure is None,
                "endpoint": self.endpoint, "load": self.load, "pid": os.getpid(),
                "node": node, "error": self.error or failure, "ranks": ranks,
                "metrics_url": self.server.metrics_url(node) if self.server is not None
                else None,
                "links": self.server.link_states() if hasattr(self.server, "link_states")
                else None,
                "drafter_mode": self.drafter_mode}

    async def _check_ranks(self) -> list[dict[str, Any]] | None:
        """This member's ranks; the first dead or hung one fails the member."""
        group = hosted_group()
        ranks = group.rank_states() if group is not None else None
        dead = [r["rank"] for r in ranks or () if r["state"] != "alive"]
        if dead and self.group_failure is None and self.server is not None:
            how = "died" if all(r["state"] == "dead" for r in ranks if r["rank"] in dead) \
                else "died or hung"
            self.group_failure = f"tensor-parallel rank(s) {dead} of this {self.role} {how}"
            await getattr(self.server, "running", self.server).set_serving(False)
            self._engine_failed(self.group_failure)
        return ranks

    def _engine_failed(self, reason: str) -> None:
        """Health is NOT_SERVING already: tell the controller why, then exit the process so
        Ray restarts this actor with a fresh engine (a verifier's requests have failed
        UNAVAILABLE, and the gateway retries new ones on another verifier; a drafter's
        verifiers draft elsewhere or decode plainly)."""
        log.error("%s: %s; restarting", self.member_id, reason)
        loop = asyncio.get_running_loop()
        loop.create_task(self._register())
        loop.call_later(FAILED_EXIT_S, os._exit, 1)

    async def drain(self) -> None:
        """Stop taking work, let what is in flight finish (bounded), stop the server."""
        if self.server is not None:
            await self.server.drain()

    @property
    def endpoint(self) -> str | None:
        if self.server is None:
            return None
        host = self.config.host
        if host in ("0.0.0.0", "::", "[::]"):
            host = ray.util.get_node_ip_address()
        return f"{host}:{self.server.port}"

    @property
    def server_draining(self) -> bool:
        running = getattr(self.server, "running", self.server)
        return bool(running.draining)

    @property
    def load(self) -> int:
        raise NotImplementedError

    @property
    def drafter_mode(self) -> str | None:
        return None

    def server_options(self) -> ServerOptions:
        return self.config.server_options(self.role, self.config.drain_timeout_s)

    async def serve(self) -> Any:
        raise NotImplementedError

    async def _start_and_register(self) -> None:
        try:
            self.server = await self.serve()
        except Exception as e:  # reported to the controller, which marks it dead
            if isinstance(e, CheckpointError):  # the model's: its message says it all
                log.error("%s failed to start: %s", self.member_id, e)
            else:
                log.exception("%s failed to start", self.member_id)
            self.error = f"{type(e).__name__}: {e}"
        await self._register()

    async def _register(self) -> None:
        """Report in by name; a restarting controller is retried with backoff (its pings
        find this member anyway once it has re-adopted it)."""
        delay = 0.2
        for _ in range(REGISTER_TRIES):
            try:
                controller = ray.get_actor(CONTROLLER_NAME, namespace=self.config.namespace)
                await controller.register.remote(self.member_id, await self.ping())
                return
            except Exception as e:  # no controller (yet), or it is restarting
                log.info("%s: register failed (%s); retrying in %.1f s", self.member_id, e,
                         delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)


class DrafterActor(_ServiceActor):
    role = "drafter"

    @property
    def load(self) -> int:
        return self.engine.load if self.server is not None else 0

    async def stats(self) -> dict[str, float]:
        """Cumulative draft rounds and their compute time."""
        if self.server is None:
            return {}
        return {"updates": self.engine.updates, "update_s_total": self.engine.update_s_total}

    async def serve(self) -> Any:
        name = served_name(self.config.model_dir)
        metrics = DrafterMetrics(name, self.config.num_steps)
        self.engine = await asyncio.to_thread(self._build_engine, metrics)
        return await serve_drafter(self.engine, self.server_options(), name, metrics=metrics)

    def _build_engine(self, metrics: DrafterMetrics) -> TimedDrafterEngine:
        opts = self.config.local_options(self.role)
        reason = no_mtp_reason(opts.model_dir)
        if reason is not None:
            raise CheckpointError(f"{reason}; serve it with --drafters 0")
        return load_drafter(opts, observer=metrics)


class VerifierActor(_ServiceActor):
    role = "verifier"

    @property
    def load(self) -> int:
        return self.server.load if self.server is not None else 0

    @property
    def drafter_mode(self) -> str:
        return str(self.config.drafter.mode)

    async def serve(self) -> Any:
        c = self.config
        opts = VerifierOptions.of_stack(c)
        server = await serve_verifier(opts, self.server_options(), client=c.client_options(),
                                      metrics=VerifierMetrics(opts.name, c.num_steps),
                                      on_failure=self._engine_failed)
        if not c.drafter.local:  # NOTE: local mode has no drafter members to follow
            self._watch = asyncio.get_running_loop().create_task(self._follow_drafters(server))
        return server

    async def stats(self) -> dict[str, float]:
        """Cumulative engine and draft-pool counters (for benchmarks)."""
        return self.server.stats() if self.server is not None else {}

    async def _follow_drafters(self, server) -> None:
        """Long-poll the controller; route to the drafters that are ready."""
        controller = ray.get_actor(CONTROLLER_NAME, namespace=self.config.namespace)
        version, current = -1, None
        while True:
            try:
                version, members = await controller.watch.remote(version, WATCH_TIMEOUT_S,
                                                                 self.member_id)
            except Exception:  # the controller restarting: try again shortly
                await asyncio.sleep(1.0)
                continue
            ready = sorted(m["endpoint"] for m in members
                           if m["role"] == "drafter" and m["state"] == "ready")
            if ready != current:
                try:
                    await server.set_drafters(ready)
                except Exception:  # the engine stopped: this verifier is going away
                    log.exception("%s cannot follow drafters", self.member_id)
                    return
                current = ready

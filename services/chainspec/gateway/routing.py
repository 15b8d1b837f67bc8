"""The verifiers a gateway routes to: one channel each, their health and load, and the
least-loaded choice.

Endpoints come from a membership source (`set_endpoints`). A refresh loop asks every
verifier for its gRPC health and `Info` each `refresh_interval_s` (and at once when the
endpoint set changes); a verifier serves requests only while its health says SERVING.
Load is the larger of the requests this gateway has in flight there and the verifier's
own running + waiting count (which includes other gateways' requests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chainspec.rpc.channel import DEFAULT_CLIENT_OPTIONS, ClientOptions, make_aio_channel
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.generated.v1 import verifier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
VERIFIER_SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING


class VerifierHandle:
    """One verifier: its stubs, what it last said about itself, and our requests there."""

    def __init__(self, endpoint: str, opts: ClientOptions) -> None:
        self.endpoint = endpoint
        self.channel = make_aio_channel(endpoint, opts)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.serving = False
        self.info: pb.VerifierInfo | None = None
        self.in_flight = 0
        self.retired = False  # left the membership; closed once idle
        self.epoch = 0  # times it was seen turning SERVING (failover: a new chance)

    @property
    def load(self) -> int:
        reported = self.info.running + self.info.waiting if self.info is not None else 0
        return max(self.in_flight, reported)

    async def refresh(self, timeout_s: float) -> None:
        try:
            health = await self.health.Check(
                health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE), timeout=timeout_s)
            self.info = await self.stub.Info(pb.VerifierInfoRequest(), timeout=timeout_s)
            serving = health.status == SERVING
        except grpc.aio.AioRpcError:
            serving = False
        self.epoch += serving and not self.serving
        self.serving = serving

    async def close(self) -> None:
        await self.channel.close()


@dataclass(frozen=True)
class VerifierView:
    """What /health shows of one verifier."""

    endpoint: str
    serving: bool
    running: int
    waiting: int
    drafters: int
    in_flight: int


class VerifierPool:
    def __init__(self, opts: ClientOptions = DEFAULT_CLIENT_OPTIONS,
                 refresh_interval_s: float = 1.0) -> None:
        self.opts, self.refresh_interval_s = opts, refresh_interval_s
        self.handles: dict[str, VerifierHandle] = {}
        self._retired: set[VerifierHandle] = set()
        self._changed = asyncio.Event()

    # -- membership ---------------------------------------------------------------------
    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """Route to exactly these verifiers from now on (on the event loop)."""
        wanted = set(endpoints)
        for endpoint in wanted - set(self.handles):
            self.handles[endpoint] = VerifierHandle(endpoint, self.opts)
        for endpoint in set(self.handles) - wanted:
            handle = self.handles.pop(endpoint)
            handle.retired, handle.serving = True, False
            self._retired.add(handle)
        self._changed.set()

    # -- routing ------------------------------------------------------------------------
    def candidates(self) -> list[VerifierHandle]:
        """Serving verifiers, least loaded first."""
        serving = [h for h in self.handles.values() if h.serving]
        return sorted(serving, key=lambda h: (h.load, h.in_flight))

    def acquire(self, handle: VerifierHandle) -> None:
        handle.in_flight += 1

    def release(self, handle: VerifierHandle) -> None:
        handle.in_flight -= 1

    def mark_unavailable(self, handle: VerifierHandle) -> None:
        """It refused with UNAVAILABLE (draining, gone): skip it until it serves again."""
        handle.serving = False
        self._changed.set()

    # -- state --------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return any(h.serving for h in self.handles.values())

    def views(self) -> list[VerifierView]:
        return [VerifierView(h.endpoint, h.serving, h.info.running if h.info else 0,
                             h.info.waiting if h.info else 0, h.info.drafters if h.info else 0,
                             h.in_flight) for h in self.handles.values()]

    def model_infos(self) -> list[pb.VerifierInfo]:
        return [h.info for h in self.handles.values() if h.serving and h.info is not None]

    # -- refresh loop -------------------------------------------------------------------
    async def run(self) -> None:
        """Refresh health and load until cancelled."""
        try:
            while True:
                self._changed.clear()
                await self.refresh()
                try:
                    await asyncio.wait_for(self._changed.wait(), self.refresh_interval_s)
                except TimeoutError:
                    pass
        finally:
            await self.close()

    async def refresh(self) -> None:
        timeout = max(self.refresh_interval_s, 2.0)
        await asyncio.gather(*(h.refresh(timeout) for h in list(self.handles.values())))
        for handle in [h for h in self._retired if h.in_flight == 0]:
            self._retired.discard(handle)
            await handle.close()

    async def close(self) -> None:
        for handle in [*self.handles.values(), *self._retired]:
            await handle.close()
        self.handles.clear()
        self._retired.clear()

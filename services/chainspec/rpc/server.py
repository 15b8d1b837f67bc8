"""One way to host a gRPC service: limits, keepalive, health, reflection, TLS, a shared
token, and drain (DESIGN 4.3).

`start_server` builds a `grpc.aio` server around the servicers that `register` adds and
returns a `RunningServer`. Health ("" and every service name) starts NOT_SERVING; the
host flips it with `set_serving(True)` once its model is loaded and warmed up. `drain()`
turns health NOT_SERVING, refuses new calls with UNAVAILABLE, lets the calls in flight
finish for up to `drain_grace_s`, then stops. A message that does not decode, on any
method and anywhere in a stream, is answered INVALID_ARGUMENT (never UNKNOWN).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from chainspec.metrics.endpoint import MetricsEndpoint
from chainspec.rpc import handlers
from chainspec.rpc.handlers import same_kind

if TYPE_CHECKING:
    from chainspec.metrics.service import GrpcServiceMetrics

# Calls that never need the token and keep working while draining: probes must see
# NOT_SERVING, not an error.
HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"
REFLECTION_PREFIX = f"/{reflection.SERVICE_NAME}/"
# Clients may send keepalive pings this often (the server default, 5 min, answers a 30 s
# client keepalive with GOAWAY "too_many_pings" after a few idle minutes).
MIN_CLIENT_PING_INTERVAL_MS = 1000
# NOTE: gRPC core reads the server's permitted ping interval from this key; the similar
# "grpc.http2.min_recv_ping_interval_without_data_ms" named in its docs is read by nobody.
PING_INTERVAL_KEY = "grpc.http2.min_ping_interval_without_data_ms"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class ServerOptions:
    """Where and how a service listens. `tls_client_ca` set means mTLS (client
    certificates required); `auth_token` set means every call but health checks must
    carry `authorization: Bearer <token>`."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port, see RunningServer.port
    max_message_bytes: int = 64 * 2 ** 20
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    auth_token: str | None = None
    drain_grace_s: float = 10.0
    metrics_port: int | None = None  # Prometheus endpoint on `host` (0: any free port)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 1024 <= self.max_message_bytes <= 2 ** 31 - 1:
            raise ValueError(f"max_message_bytes must be in [1024, 2^31), "
                             f"got {self.max_message_bytes}")
        if self.keepalive_time_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("keepalive_time_s and keepalive_timeout_s must be > 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth_token must not be empty (leave it unset to disable)")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def bearer_token_ok(metadata, token: str) -> bool:
    """Whether the call metadata carries `authorization: Bearer <token>`."""
    want = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == "authorization":
            got = value.encode() if isinstance(value, str) else value
            return hmac.compare_digest(got, want)
    return False


class _CallGate(grpc.aio.ServerInterceptor):
    """Token check, drain refusal and in-flight counting for every call."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.draining = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        handler = _decode_checked(handler)
        method = details.method
        if self.token and not method.startswith(HEALTH_PREFIX) \
                and not bearer_token_ok(details.invocation_metadata, self.token):
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                             "missing or wrong bearer token")
        if method.startswith((HEALTH_PREFIX, REFLECTION_PREFIX)):
            return handler  # NOTE: not counted: a health Watch would block drain forever
        if self.draining:
            return _refusing(handler, grpc.StatusCode.UNAVAILABLE,
                             "server is draining; retry on another replica")
        return _counted(handler, self)

    def enter(self) -> None:
        self.active += 1
        self.idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.idle.set()


class _Undecodable:
    """Stands in for a request message that failed to decode."""

    def __init__(self, error: Exception) -> None:
        self.details = f"request message does not decode: {error or type(error).__name__}"


def _tolerant(deserialize):
    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as e:  # NOTE: client bytes, whatever the parser raises
            return _Undecodable(e)
    return parse


async def _check(request, context) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)


async def _checked_stream(requests, context):
    async for request in requests:
        await _check(request, context)
        yield request


def _decode_checked(handler) -> grpc.RpcMethodHandler:
    """`handler` answering INVALID_ARGUMENT for a request (or any message of a request
    stream) that does not decode; grpc itself would answer UNKNOWN."""
    inner = handlers.behavior(handler)
    if handler.request_deserializer is None or not (
            inspect.isasyncgenfunction(inner) or inspect.iscoroutinefunction(inner)):
        return handler  # raw bytes, or a sync behavior (grpc's pool): nothing to check

    async def checked(request, context):
        if handler.request_streaming:
            return _checked_stream(request, context)
        await _check(request, context)
        return request

    if inspect.isasyncgenfunction(inner):
        async def stream(request, context):
            responses = inner(await checked(request, context), context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()
        behavior = stream
    else:
        async def call(request, context):
            return await inner(await checked(request, context), context)
        behavior = call
    return same_kind(handler, behavior, _tolerant(handler.request_deserializer))


def _refusing(handler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def refuse(_request, context):
        await context.abort(code, message)
    return same_kind(handler, refuse)


def _counted(handler, gate: _CallGate) -> grpc.RpcMethodHandler:
    inner = handlers.behavior(handler)
    if inspect.isasyncgenfunction(inner):
        async def stream(request, context):
            gate.enter()
            responses = inner(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()
                gate.leave()
        return same_kind(handler, stream)
    if inspect.iscoroutinefunction(inner):
        async def call(request, context):
            gate.enter()
            try:
                return await inner(request, context)
            finally:
                gate.leave()
        return same_kind(handler, call)
    return handler  # a sync behavior runs on grpc's own pool; not ours to count


class RunningServer:
    """A started server: its address, health switch, drain and stop."""

    def __init__(self, server: grpc.aio.Server, opts: ServerOptions, port: int,
                 health_servicer: health.aio.HealthServicer, service_names: Sequence[str],
                 gate: _CallGate) -> None:
        self.server, self.opts, self.port = server, opts, port
        self._health, self._names, self._gate = health_servicer, tuple(service_names), gate
        self._drain_hooks: list[Callable[[], Awaitable[None] | None]] = []
        self._stop_hooks: list[Callable[[], None]] = []
        self._stopped = False
        self.metrics: MetricsEndpoint | None = None  # serves the host's registry

    @property
    def address(self) -> str:
        host = self.opts.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def draining(self) -> bool:
        return self._gate.draining

    def metrics_url(self, advertise: str | None = None) -> str | None:
        """The Prometheus endpoint (`advertise` replaces a wildcard host), if any."""
        return self.metrics.url(advertise) if self.metrics is not None else None

    def add_drain_hook(self, hook: Callable[[], Awaitable[None] | None]) -> None:
        """Called at the start of `drain()`, e.g. to make open streams wind down."""
        self._drain_hooks.append(hook)

    def add_stop_hook(self, hook: Callable[[], None]) -> None:
        """Called once the server has stopped, e.g. to shut a worker thread down."""
        self._stop_hooks.append(hook)

    async def set_serving(self, serving: bool) -> None:
        """Health of "" and every service; refused (stays NOT_SERVING) once draining."""
        if serving and self.draining:
            raise RuntimeError("a draining server cannot serve again")
        for name in ("", *self._names):
            await self._health.set(name, SERVING if serving else NOT_SERVING)

    async def drain(self) -> None:
        """NOT_SERVING, UNAVAILABLE for new calls, up to drain_grace_s for calls in
        flight, then stop."""
        if self._stopped:
            return
        await self.set_serving(False)
        self._gate.draining = True
        for hook in self._drain_hooks:
            result = hook()
            if inspect.isawaitable(result):
                await result
        try:
            await asyncio.wait_for(self._gate.idle.wait(), self.opts.drain_grace_s)
        except TimeoutError:
            pass  # NOTE: stop() below cancels what is left
        await self.stop(0)

    async def stop(self, grace: float | None = None) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for hook in self._stop_hooks:
            hook()
        if self.metrics is not None:
            self.metrics.close()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def server_options(opts: ServerOptions) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", opts.max_message_bytes),
        ("grpc.max_send_message_length", opts.max_message_bytes),
        ("grpc.keepalive_time_ms", int(opts.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(opts.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        (PING_INTERVAL_KEY, permitted_ping_interval_ms(opts.keepalive_time_s)),
        # NOTE: with SO_REUSEPORT a second server on a fixed port would bind silently.
        ("grpc.so_reuseport", 0),
    ]


def permitted_ping_interval_ms(keepalive_time_s: float) -> int:
    """How often a client may ping: never slower than the pings our own clients send
    (same keepalive setting on both ends), so keepalive can never earn a GOAWAY."""
    return max(1, min(MIN_CLIENT_PING_INTERVAL_MS, int(keepalive_time_s * 1000) // 2))


def server_credentials(opts: ServerOptions) -> grpc.ServerCredentials:
    """TLS (or mTLS with tls_client_ca) credentials from PEM files."""
    key, cert = _read(opts.tls_key, "tls_key"), _read(opts.tls_cert, "tls_cert")
    ca = _read(opts.tls_client_ca, "tls_client_ca") if opts.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def _read(path: Path | None, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"{what}: cannot read {path}: {e.strerror}") from None


async def start_server(opts: ServerOptions, register: Callable[[grpc.aio.Server], None],
                       service_names: Sequence[str],
                       metrics: GrpcServiceMetrics | None = None) -> RunningServer:
    """Start a server with the servicers `register` adds; health starts NOT_SERVING.
    With `metrics`: calls are counted into its registry, which `opts.metrics_port` (when
    set) serves over HTTP until the server stops."""
    gate = _CallGate(opts.auth_token)
    # NOTE: metrics first, so they see the calls the gate refuses
    interceptors = [metrics.calls.interceptor(), gate] if metrics is not None else [gate]
    server = grpc.aio.server(interceptors=interceptors, options=server_options(opts))
    register(server)
    health_servicer = health.aio.HealthServicer()
    for name in ("", *service_names):
        await health_servicer.set(name, NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bind = f"[{opts.host}]:{opts.port}" if ":" in opts.host else f"{opts.host}:{opts.port}"
    try:
        port = server.add_secure_port(bind, server_credentials(opts)) if opts.tls \
            else server.add_insecure_port(bind)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {bind}: {e}") from None
    running = RunningServer(server, opts, port, health_servicer, service_names, gate)
    try:
        if metrics is not None and opts.metrics_port is not None:
            running.metrics = MetricsEndpoint(metrics.registry, opts.host, opts.metrics_port)
        await server.start()
    except BaseException:
        await running.stop(0)
        raise
    return running

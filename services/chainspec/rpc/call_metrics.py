"""gRPC server call metrics: an interceptor counting calls by method and status code,
timing them, and counting streamed messages (go-grpc-prometheus's shape).

Registered first in the server's interceptor chain, so it also sees the calls the token
check and the drain gate refuse (UNAUTHENTICATED, UNAVAILABLE). Labels are the full method
name (`/chainspec.v1.Drafter/Draft`; a fixed set) and the status code name.
"""

from __future__ import annotations

import asyncio
import inspect
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from chainspec.metrics.buckets import CALL_S
from chainspec.rpc.handlers import behavior, same_kind


class CallMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter("chainspec_grpc_server_started", "gRPC calls started",
                               ["method"], registry=registry)
        self.handled = Counter("chainspec_grpc_server_handled", "gRPC calls finished, by "
                               "status code", ["method", "code"], registry=registry)
        self.seconds = Histogram("chainspec_grpc_server_handling_seconds", "gRPC call "
                                 "duration (a stream: its lifetime)", ["method"],
                                 buckets=CALL_S, registry=registry)
        self.received = Counter("chainspec_grpc_server_msg_received", "Messages received on "
                                "client-streaming calls", ["method"], registry=registry)
        self.sent = Counter("chainspec_grpc_server_msg_sent", "Messages sent on "
                            "server-streaming calls", ["method"], registry=registry)

    def interceptor(self) -> CallMetricsInterceptor:
        return CallMetricsInterceptor(self)


class CallMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: CallMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        return _observed(handler, _Call(self.metrics, details.method, handler))


class _Call:
    """One method's children of the call metrics."""

    def __init__(self, metrics: CallMetrics, method: str, handler) -> None:
        self.metrics, self.method = metrics, method
        # message counts only for the streaming directions (no zero series for the rest)
        self.received = metrics.received.labels(method) if handler.request_streaming else None
        self.sent = metrics.sent.labels(method) if handler.response_streaming else None

    def start(self) -> float:
        self.metrics.started.labels(self.method).inc()
        return time.perf_counter()

    def finish(self, started: float, code: grpc.StatusCode) -> None:
        self.metrics.handled.labels(self.method, code.name).inc()
        self.metrics.seconds.labels(self.method).observe(time.perf_counter() - started)

    async def count_requests(self, requests):
        async for request in requests:
            self.received.inc()
            yield request


def _code(context, error: BaseException | None) -> grpc.StatusCode:
    """The call's final status: what the servicer set (abort included), else OK, CANCELLED
    for a cancelled call, UNKNOWN for an exception."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # the cython context may hand back the numeric code
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if error is None:
        return grpc.StatusCode.OK
    cancelled = isinstance(error, asyncio.CancelledError | GeneratorExit)
    return grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.UNKNOWN


def _observed(handler, call: _Call) -> grpc.RpcMethodHandler:
    inner = behavior(handler)
    streaming_in = handler.request_streaming
    if inspect.isasyncgenfunction(inner):
        async def stream(request, context):
            started, error = call.start(), None
            request = call.count_requests(request) if streaming_in else request
            responses = inner(request, context)
            try:
                async for response in responses:
                    if call.sent is not None:
                        call.sent.inc()
                    yield response
            except BaseException as e:
                error = e
                raise
            finally:
                await responses.aclose()  # NOTE: runs the inner wrappers' cleanup now
                call.finish(started, _code(context, error))
        return same_kind(handler, stream)
    if inspect.iscoroutinefunction(inner):
        async def unary(request, context):
            started, error = call.start(), None
            request = call.count_requests(request) if streaming_in else request
            try:
                return await inner(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                call.finish(started, _code(context, error))
        return same_kind(handler, unary)
    return handler  # a sync behavior runs on grpc's own pool; none of ours is

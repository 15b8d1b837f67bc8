"""The gateway's ASGI app: the routes around a `Gateway`, the error handlers that turn
every failure into an OpenAI-style body, and status metrics. Kept apart from `app.py` so
that the routes (which use the `Gateway`) and the app object import in one direction."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from chainspec.gateway.app import Gateway
from chainspec.gateway.body_limit import BodyLimit
from chainspec.gateway.errors import APIError, not_found
from chainspec.gateway.metrics import GatewayMetrics
from chainspec.gateway.routes import router


def build_app(gateway: Gateway) -> StatusMetrics:
    app = FastAPI(title="chainspec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    app.include_router(router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(BodyLimit, max_bytes=gateway.config.max_body_bytes)
    return StatusMetrics(app, gateway.metrics)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    err = not_found(request.url.path) if e.status_code == 404 else \
        APIError(e.status_code, str(e.detail), "invalid_request_error")
    return JSONResponse(err.body(), err.status, headers=err.headers)


async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    err = APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error", None,
                   "internal_error")
    return JSONResponse(err.body(), 500)


class StatusMetrics:
    """Pure ASGI wrapper counting response codes per route (it never buffers a body,
    so streaming and disconnects pass through untouched)."""

    def __init__(self, app: FastAPI, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, started = scope["path"], time.perf_counter()

        async def observed_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.observe(path, message["status"])
                self.metrics.headers_sent(path, message["status"],
                                          time.perf_counter() - started)
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                self.metrics.answered(path, time.perf_counter() - started)
            await send(message)
        await self.app(scope, receive, observed_send)

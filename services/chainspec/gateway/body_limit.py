"""The request body's size limit, enforced before the body is read (pure ASGI).

A declared `Content-Length` over the limit is answered 413 at once, without a byte of the
body read (and without the app running). A body of unknown length (chunked) is counted
as the app reads it; the read that crosses the limit raises `APIError(413)`, which the
app's error handler answers. Either way the connection stays open for the next request:
the server discards the rest of the refused body.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from chainspec.gateway.errors import APIError, invalid, too_large


class BodyLimit:
    """Refuses request bodies larger than `max_bytes` with 413."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._declared(scope["headers"])
        if refusal is not None:  # answered unread; the app never runs
            response = JSONResponse(refusal.body(), refusal.status, headers=refusal.headers)
            return await response(scope, receive, send)
        await self.app(scope, self._counted(receive), send)

    def _declared(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
        """The error a declared Content-Length earns, if any."""
        value = dict(headers).get(b"content-length")
        if value is None:
            return None
        if not value.isdigit():
            return invalid(None, f"Content-Length {value!r} is not a byte count")
        if len(value) > 20 or int(value) > self.max_bytes:  # (no int() of huge numbers)
            return self._too_large(f"declares {value.decode()} bytes")
        return None

    def _counted(self, receive):
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large(f"has more than {self.max_bytes} bytes")
            return message
        return counted_receive

    def _too_large(self, what: str) -> APIError:
        return too_large(f"the request body {what}; this server accepts at most "
                         f"{self.max_bytes} bytes")

"""Server-sent events for streamed responses.

Events: (chat only) a first chunk with the assistant role, one chunk per text delta from
the verifier, a chunk with the finish reason, with `stream_options.include_usage` a chunk
with no choices and the usage, then `data: [DONE]`. An error after the first event is
sent as one `data: {"error": ...}` event and the stream ends without `[DONE]`. However
the stream ends -- finished, failed, or the client gone (the ASGI server cancels the
generator) -- the gRPC call is cancelled, which aborts the request in the verifier.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse

from chainspec.gateway.client import GenerationStream
from chainspec.gateway.errors import APIError
from chainspec.gateway.responses import Envelope, Format, chunk_body, finish_reason

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def stream_events(stream: GenerationStream, fmt: type[Format], env: Envelope,
                        include_usage: bool) -> AsyncIterator[str]:
    def chunk(choice: dict[str, Any]) -> str:
        return event(chunk_body(fmt, env, [choice], include_usage))
    try:
        if fmt.role_chunk:
            yield chunk(fmt.delta("", None, role=True))
        async for msg in stream.messages():
            if msg.HasField("chunk"):
                if msg.chunk.text:
                    yield chunk(fmt.delta(msg.chunk.text, None))
                continue
            reason = finish_reason(msg.finished)
            yield chunk(fmt.delta(None, reason) if fmt.role_chunk else fmt.delta("", reason))
            if include_usage:
                yield event(chunk_body(fmt, env, [], True, msg.finished.stats))
        yield DONE
    except APIError as e:
        yield event(e.body())
    finally:
        stream.close()


class EventStreamResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends -- even when the client
    left before the first event, when the body generator never starts."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()

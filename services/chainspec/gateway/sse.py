"""Server-sent events for streamed responses.

Events: per choice (chat only) a first chunk with the assistant role and, with echo, a
chunk of the echoed text; then one chunk per text delta from the verifier and a chunk
with the finish reason, choices interleaved as their verifier requests produce them
(each chunk carries its choice's `index`); with `stream_options.include_usage` a chunk
with no choices and the usage of all choices, then `data: [DONE]`. An error after the first event is
sent as one `data: {"error": ...}` event and the stream ends without `[DONE]`. However
the stream ends -- finished, failed, or the client gone (the ASGI server cancels the
generator) -- the gRPC call is cancelled, which aborts the request in the verifier.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.responses import StreamingResponse

from chainspec.gateway.choices import ChoiceState, Shape
from chainspec.gateway.client import GenerationStream
from chainspec.gateway.errors import APIError
from chainspec.gateway.fanout import interleave, merge_stats
from chainspec.gateway.responses import Envelope, Format, chunk_body, finish_reason
from chainspec.gateway.strict_json import dumps

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict[str, Any]) -> str:
    """One SSE event; a non-finite float raises APIError (strict_json), which
    `stream_events` sends as the stream's error event."""
    return f"data: {dumps(data)}\n\n"


async def stream_events(streams: Sequence[GenerationStream], fmt: type[Format],
                        env: Envelope, include_usage: bool, shape: Shape
                        ) -> AsyncIterator[str]:
    def chunk(choice: dict[str, Any]) -> str:
        return event(chunk_body(fmt, env, [choice], include_usage))
    states = [ChoiceState(i, []) for i in range(len(streams))]
    offsets = [len(shape.echo)] * len(streams)  # text_offset of each choice's next token
    try:
        for i in range(len(streams)):
            if fmt.role_chunk:
                yield chunk(fmt.delta("", None, role=True, index=i))
            if shape.echo:
                yield chunk(fmt.delta(shape.echo, None, index=i))
        async for i, msg in interleave(streams):
            states[i].add(msg)
            if msg.HasField("chunk"):
                lps = shape.logprobs_of(fmt, msg.chunk.logprobs, offsets[i])
                offsets[i] += len(msg.chunk.text)
                if msg.chunk.text or lps:
                    yield chunk(fmt.delta(msg.chunk.text, None, index=i, logprobs=lps))
                continue
            yield chunk(fmt.delta(None, finish_reason(msg.finished), index=i))
        if include_usage:
            stats = merge_stats([s.finished.stats for s in states if s.finished])
            yield event(chunk_body(fmt, env, [], True, stats))
        yield DONE
    except APIError as e:
        yield event(e.body())
    finally:
        for stream in streams:
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

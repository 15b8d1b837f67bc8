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

from chainspec.gateway.choices import Shape
from chainspec.gateway.client import GenerationStream
from chainspec.gateway.errors import APIError
from chainspec.gateway.fanout import interleave, merge_stats
from chainspec.gateway.responses import Envelope, Format, chunk_body, finish_reason
from chainspec.gateway.strict_json import dumps
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict[str, Any]) -> str:
    """One SSE event; a non-finite float raises APIError (strict_json), which
    `stream_events` sends as the stream's error event."""
    return f"data: {dumps(data)}\n\n"


async def stream_events(streams: Sequence[GenerationStream], fmt: type[Format],
                        env: Envelope, include_usage: bool, shape: Shape
                        ) -> AsyncIterator[str]:
    chunk = ChunkEvents(fmt, env, include_usage)
    finished: list[pb.GenerateFinished | None] = [None] * len(streams)
    offsets = [len(shape.echo)] * len(streams)  # text_offset of each choice's next token
    try:
        for i in range(len(streams)):
            if fmt.role_chunk:
                yield chunk(fmt.delta("", None, role=True, index=i))
            if shape.echo:
                yield chunk(fmt.delta(shape.echo, None, index=i))
        async for i, msg in _messages(streams):
            if msg.HasField("chunk"):
                lps = shape.logprobs_of(fmt, msg.chunk.logprobs, offsets[i])
                text = msg.chunk.text
                offsets[i] += len(text)
                if text or lps:
                    yield chunk(fmt.delta(text, None, index=i, logprobs=lps))
                continue
            finished[i] = msg.finished
            yield chunk(fmt.delta(None, finish_reason(msg.finished), index=i))
        if include_usage:
            stats = merge_stats([f.stats for f in finished if f is not None])
            yield event(chunk_body(fmt, env, [], True, stats))
        yield DONE
    except APIError as e:
        yield event(e.body())
    finally:
        for stream in streams:
            stream.close()


def _messages(streams: Sequence[GenerationStream]
              ) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(choice index, message); one stream (n = 1) is read directly, without the task
    per message that interleaving n streams takes."""
    if len(streams) > 1:
        return interleave(streams)

    async def single() -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        async for msg in streams[0].messages():
            yield 0, msg
    return single()


class ChunkEvents:
    """`event(chunk_body(fmt, env, [choice], include_usage))` for one choice, with the
    envelope's JSON rendered once per response rather than once per chunk."""

    def __init__(self, fmt: type[Format], env: Envelope, include_usage: bool) -> None:
        body = chunk_body(fmt, env, [], include_usage)
        text = dumps(body)
        cut = text.rindex('"choices":[]') + len('"choices":[')  # NOTE: after the model
        self.head, self.tail = "data: " + text[:cut], text[cut:] + "\n\n"

    def __call__(self, choice: dict[str, Any]) -> str:
        return f"{self.head}{dumps(choice)}{self.tail}"


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

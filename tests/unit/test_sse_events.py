"""The gateway's SSE chunks: the pre-rendered envelope (`ChunkEvents`) writes exactly the
event that rendering the whole chunk body writes, and a single stream is read in order
with its finish and usage."""

import asyncio

import pytest

from chainspec.gateway.choices import Shape
from chainspec.gateway.errors import APIError
from chainspec.gateway.responses import ChatFormat, CompletionFormat, Envelope, chunk_body
from chainspec.gateway.sse import DONE, ChunkEvents, event, stream_events
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

ENVELOPES = [Envelope("cmpl-1", 1700000000, "demo"),
             Envelope("x", 0, 'odd "choices":[] "model" ünï\n'),  # the key inside a name
             Envelope("", 2**40, "")]


@pytest.mark.parametrize("env", ENVELOPES)
@pytest.mark.parametrize("fmt", [CompletionFormat, ChatFormat])
@pytest.mark.parametrize("usage", [False, True])
def test_chunk_events_equal_full_render(env, fmt, usage):
    events = ChunkEvents(fmt, env, usage)
    for choice in (fmt.delta("", None, role=True, index=0), fmt.delta("é\"x\n", None, index=3),
                   fmt.delta(None, "stop", index=1),
                   fmt.delta("a", None, logprobs={"tokens": ["a"], "token_logprobs": [-0.5]})):
        assert events(choice) == event(chunk_body(fmt, env, [choice], usage))


def test_chunk_events_refuse_non_finite():
    events = ChunkEvents(CompletionFormat, ENVELOPES[0], False)
    with pytest.raises(APIError):
        events(CompletionFormat.delta("a", None, logprobs={"token_logprobs": [float("nan")]}))


class _Stream:
    def __init__(self, messages):
        self._messages, self.closed = messages, False

    async def messages(self):
        for m in self._messages:
            yield m

    def close(self):
        self.closed = True


def _collect(stream, usage):
    async def run():
        return [e async for e in stream_events([stream], CompletionFormat, ENVELOPES[0],
                                               usage, Shape())]
    return asyncio.run(run())


def test_single_stream_in_order_with_finish_and_usage():
    chunks = [pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[i], text=t))
              for i, t in enumerate(["He", "", "llo"])]
    stats = pb.RequestStats(prompt_tokens=4, completion_tokens=3)
    done = pb.GenerateResponse(finished=pb.GenerateFinished(reason=pb.FINISH_REASON_LENGTH,
                                                            stats=stats))
    stream = _Stream(chunks + [done])
    events = _collect(stream, True)
    texts = [e for e in events if '"text":"' in e and '"finish_reason":null' in e]
    assert [t.split('"text":"')[1].split('"')[0] for t in texts] == ["He", "llo"]  # "" dropped
    assert '"finish_reason":"length"' in events[-3]
    assert '"choices":[]' in events[-2] and '"completion_tokens":3' in events[-2]
    assert events[-1] == DONE and stream.closed

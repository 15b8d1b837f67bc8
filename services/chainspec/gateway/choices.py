"""Each choice's text as the client asked for it: the verifier's output, with the echoed
prompt before it and, with `include_stop_str_in_output`, the matched stop string after.

The verifier returns the text before a stop string's match and, for a stop token id,
the token itself (its text too, unless it is a special token). It does not say which
stop string matched, so `include_stop_str_in_output` is refused with more than one
stop string (schemas.py); with one, a STOP finish whose last token is not one of the
stop token ids was that string's match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chainspec.gateway.client import GenerationStream
from chainspec.gateway.errors import APIError
from chainspec.gateway.fanout import merge_stats
from chainspec.gateway.responses import Envelope, Format, finish_reason, full_body
from chainspec.rpc.generated.v1 import verifier_pb2 as pb


@dataclass(frozen=True)
class Shape:
    """What the gateway adds around every choice's output text."""

    echo: str = ""  # before the output: the prompt (completions) or the last message (chat)
    stop: str | None = None  # include_stop_str_in_output: the one stop string
    stop_token_ids: frozenset[int] = frozenset()

    def ending(self, finished: pb.GenerateFinished, last_token: int | None) -> str:
        """Text after the verifier's: the matched stop string when it is to be shown."""
        if self.stop is None or finished.reason != pb.FINISH_REASON_STOP:
            return ""
        if last_token is not None and last_token in self.stop_token_ids:
            return ""  # a stop token id matched (it is checked before stop strings)
        return self.stop


@dataclass
class ChoiceState:
    """One choice while its stream is read."""

    index: int
    parts: list[str]
    last_token: int | None = None
    finished: pb.GenerateFinished | None = None

    def add(self, msg: pb.GenerateResponse) -> None:
        if msg.HasField("chunk"):
            self.parts.append(msg.chunk.text)
            if msg.chunk.token_ids:
                self.last_token = msg.chunk.token_ids[-1]
        else:
            self.finished = msg.finished


async def read_choice(index: int, stream: GenerationStream) -> ChoiceState:
    state = ChoiceState(index, [])
    async for msg in stream.messages():
        state.add(msg)
        if state.finished is not None:
            return state
    raise APIError(502, "the verifier ended the stream without finishing the request",
                   "server_error", None, "internal_error")


def whole_body(fmt: type[Format], env: Envelope, shape: Shape,
               states: Sequence[ChoiceState]) -> dict:
    """The non-streamed response of all choices."""
    choices = []
    for s in states:
        assert s.finished is not None
        text = shape.echo + "".join(s.parts) + shape.ending(s.finished, s.last_token)
        choices.append(fmt.choice(text, finish_reason(s.finished), s.index))
    return full_body(fmt, env, choices, merge_stats([s.finished.stats for s in states]))

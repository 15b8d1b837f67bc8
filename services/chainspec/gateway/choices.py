"""Each choice as the client asked for it: the verifier's output text (the verifier
itself keeps a matched stop string with include_stop_str_in_output), the echoed prompt
before it, and the logprobs of its tokens when asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chainspec.gateway.client import GenerationStream
from chainspec.gateway.errors import APIError
from chainspec.gateway.fanout import merge_stats
from chainspec.gateway.logprobs import TokenBytes, TokenText, token_id_text
from chainspec.gateway.responses import Envelope, Format, finish_reason, full_body
from chainspec.rpc.generated.v1 import verifier_pb2 as pb


@dataclass(frozen=True)
class Shape:
    """What the gateway adds around every choice's output text."""

    echo: str = ""  # before the output: the prompt (completions) or the last message (chat)
    logprobs: bool = False  # show the tokens' logprobs
    token_text: TokenText = token_id_text
    token_bytes: TokenBytes | None = None  # None: the UTF-8 of token_text

    def logprobs_of(self, fmt: type[Format], lps: Sequence[pb.TokenLogprob],
                    offset: int) -> dict | None:
        if not self.logprobs:
            return None
        return fmt.logprobs(lps, self.token_text, offset, self.token_bytes)


@dataclass
class ChoiceState:
    """One choice while its stream is read."""

    index: int
    parts: list[str]
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finished: pb.GenerateFinished | None = None

    def add(self, msg: pb.GenerateResponse) -> None:
        if msg.HasField("chunk"):
            self.parts.append(msg.chunk.text)
            self.logprobs.extend(msg.chunk.logprobs)
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
        text = shape.echo + "".join(s.parts)
        choices.append(fmt.choice(text, finish_reason(s.finished), s.index,
                                  shape.logprobs_of(fmt, s.logprobs, len(shape.echo))))
    return full_body(fmt, env, choices, merge_stats([s.finished.stats for s in states]))

"""Mid-stream failover: a Generate stream whose verifier fails after it started resumes on
another verifier, and the client sees one uninterrupted stream.

What resumes: a call that ends with a status a dying or unreachable verifier gives
(UNAVAILABLE: connection reset, engine stopped, a TP group's lost rank; INTERNAL and
UNKNOWN: a stream cut off mid-message). A client error (INVALID_ARGUMENT, ...), the
request's own deadline, or a request the verifier finished with an error does not.

How: the request goes again to a serving verifier that takes continuations
(VerifierInfo.continues), least loaded first and never one that failed it (unless that
one has since been seen out of service and back), as a
*continuation* (GenerateRequest.continuation): the same prompt, sampling, seed, stop
conditions and logprob settings, plus the token ids the client was sent and the length
of their text. The verifier counts those tokens as already generated (max_tokens,
min_tokens, penalties, stop strings) and keys seeded noise by absolute position, so the
rest is what one uninterrupted run gives; it sends only the text the client does not
have yet, held-back text included. Usage is the new verifier's: the original prompt and
every completion token. Bounded: at most `max_resumes` per choice; when no verifier can
take it, waiting `wait_s` for one (a restarting group may come back), then the error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from chainspec.rpc.generated.v1 import verifier_pb2 as pb

RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                       grpc.StatusCode.UNKNOWN})
MAX_RESUMES = 2  # per choice; then the stream ends with the error event
RESUME_WAIT_S = 10.0  # how long a resume waits for a verifier that can take it
POLL_S = 0.1  # how often it looks meanwhile


@dataclass(frozen=True)
class Failover:
    """How streams resume. `on_resume`: called once per resumed stream (a metric)."""

    max_resumes: int = MAX_RESUMES
    wait_s: float = RESUME_WAIT_S
    poll_s: float = POLL_S
    on_resume: Callable[[], None] = field(default=lambda: None, compare=False)

    def allows(self, error: grpc.aio.AioRpcError, resumes: int) -> bool:
        """Whether a stream that failed with `error` after `resumes` resumes goes on."""
        return resumes < self.max_resumes and error.code() in RESUMABLE


DEFAULT_FAILOVER = Failover()


@dataclass(frozen=True)
class Continuation:
    """The output a resumed request already has (GenerateRequest.continuation)."""

    token_ids: tuple[int, ...]
    text_sent: int  # characters of their text the client has

    def fill(self, c: pb.Continuation) -> None:
        c.token_ids.extend(self.token_ids)
        c.text_sent = self.text_sent


@dataclass
class Progress:
    """What one choice's client has been sent so far: token ids and characters of text."""

    token_ids: list[int] = field(default_factory=list)
    text_sent: int = 0

    def add(self, msg: pb.GenerateResponse) -> None:
        if msg.HasField("chunk"):
            self.token_ids.extend(msg.chunk.token_ids)
            self.text_sent += len(msg.chunk.text)

    def continuation(self) -> Continuation:
        return Continuation(tuple(self.token_ids), self.text_sent)


@dataclass
class Avoid:
    """Verifiers that failed this stream, by endpoint, with the serving epoch they failed
    in (`VerifierHandle.epoch`): one is tried again only in a later epoch."""

    failed: dict[str, int] = field(default_factory=dict)

    def add(self, endpoint: str, epoch: int) -> None:
        self.failed[endpoint] = epoch

    def allows(self, endpoint: str, epoch: int) -> bool:
        return epoch > self.failed.get(endpoint, -1)

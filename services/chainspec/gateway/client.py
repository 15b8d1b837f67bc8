"""One request to the verifiers: build the `GenerateRequest`, pick a verifier, and stream.

`open_generation` tries the serving verifiers least-loaded first and returns once one of
them has sent the first message, so everything that can go wrong before the first token
(bad input, a full or draining verifier) is still an HTTP status. A full
(RESOURCE_EXHAUSTED) or draining/unreachable (UNAVAILABLE) verifier passes the request on
to the next one; when none is left the answer is 429 resp. 503. (gRPC's own message-size
limit is also RESOURCE_EXHAUSTED; that one is 413 at once.) `close()` cancels the
gRPC call, which aborts the request in the verifier and releases it in the drafters.
A stream whose verifier fails after its first message resumes on another verifier
(gateway/failover.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from chainspec.engine.grammar import GrammarSpec
from chainspec.gateway import structured_output
from chainspec.gateway.errors import APIError, from_grpc, invalid, unavailable, unsupported
from chainspec.gateway.failover import (
    DEFAULT_FAILOVER,
    Avoid,
    Continuation,
    Failover,
    Progress,
)
from chainspec.gateway.routing import VerifierHandle, VerifierPool
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

RETRY_STATUSES = (429, 503)  # a full or draining verifier: the next one may take it


@dataclass(frozen=True)
class Processing:
    """Logits processing, logprobs and the grammar (verifier.proto SamplingParams 5..12);
    defaults: off."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    grammar: GrammarSpec | None = None  # structured output (SamplingParams 12); None: off

    def fill(self, s: pb.SamplingParams) -> None:
        s.presence_penalty, s.frequency_penalty = self.presence_penalty, self.frequency_penalty
        if self.repetition_penalty != 1.0:
            s.repetition_penalty = self.repetition_penalty
        for tok, bias in self.logit_bias:
            s.logit_bias[tok] = bias
        s.min_p, s.min_tokens = self.min_p, self.min_tokens
        if self.logprobs is not None:
            s.logprobs = self.logprobs
        if self.grammar is not None:
            structured_output.fill(self.grammar, s.grammar)


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request in verifier terms."""

    request_id: str
    prompt: str | list[int]
    max_tokens: int | None  # None: the verifier's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str: bool = False
    processing: Processing = field(default_factory=lambda: Processing())
    priority: int = 0  # admission priority (vLLM's; the verifier's policy decides)
    parent_request_id: str = ""  # the client request this is one choice of (fanout)
    num_speculative_tokens: int | None = None  # cap on drafts per round (None: K; 0: off)
    continuation: Continuation | None = None  # a resumed request's output so far
    cache_salt: str = ""  # vLLM's: shares cached prefix blocks only with the same salt

    def message(self) -> pb.GenerateRequest:
        # NOTE: every value is already in its wire range (schemas: uint32 counts, uint64
        # seed, UTF-8 text), so the proto assignments below cannot raise
        req = pb.GenerateRequest(request_id=self.request_id)
        if isinstance(self.prompt, str):
            req.text = self.prompt
        else:
            req.tokens.ids.extend(self.prompt)
        req.sampling.temperature = self.temperature
        req.sampling.top_p = self.top_p
        req.sampling.top_k = max(self.top_k, 0)
        if self.seed is not None:
            req.sampling.seed = self.seed
        req.stop.max_tokens = self.max_tokens or 0
        req.stop.stop.extend(self.stop)
        req.stop.stop_token_ids.extend(self.stop_token_ids)
        req.stop.include_stop_str_in_output = self.include_stop_str
        self.processing.fill(req.sampling)
        req.stop.ignore_eos = self.ignore_eos
        req.priority, req.parent_request_id = self.priority, self.parent_request_id
        if self.num_speculative_tokens is not None:
            req.num_speculative_tokens = self.num_speculative_tokens
        if self.continuation is not None:
            self.continuation.fill(req.continuation)
        req.cache_salt = self.cache_salt
        return req

    def resumed(self, attempt: int, progress: Progress) -> GenerationSpec:
        """This request as a continuation after `progress` (its own verifier request id:
        the failed verifier may still hold the old one)."""
        return dataclasses.replace(self, request_id=f"{self.request_id}-r{attempt}",
                                   continuation=progress.continuation())


@dataclass(frozen=True)
class CallOptions:
    """How a request's Generate calls are made and resumed."""

    prompt_field: str  # the HTTP name of the prompt, for error messages
    timeout_s: float  # the whole request's deadline at the verifiers, resumes included
    retry_after_s: int
    failover: Failover = DEFAULT_FAILOVER


@dataclass(frozen=True)
class Opened:
    """A Generate call and its first message."""

    handle: VerifierHandle
    call: object
    first: pb.GenerateResponse


class GenerationStream:
    """A Generate call that has produced its first message; when its verifier fails
    mid-stream it resumes on another one, as one stream to its reader."""

    def __init__(self, pool: VerifierPool, spec: GenerationSpec, opened: Opened,
                 opts: CallOptions) -> None:
        self.pool, self.spec, self.opts = pool, spec, opts
        self.handle, self.call, self.first = opened.handle, opened.call, opened.first
        self.deadline = time.monotonic() + opts.timeout_s
        self.progress, self.avoid, self.resumes = Progress(), Avoid(), 0
        self._closed = False

    @property
    def endpoint(self) -> str:
        return self.handle.endpoint

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """Every message, the first included; a failed call that cannot resume raises
        APIError."""
        while True:
            try:
                async for msg in self._read():
                    self.progress.add(msg)
                    yield msg
                return
            except grpc.aio.AioRpcError as e:
                error = from_grpc(e, self.opts.prompt_field, self.opts.retry_after_s)
                if not self.opts.failover.allows(e, self.resumes):
                    raise error from None
                await self._resume(e)

    async def _read(self) -> AsyncIterator[pb.GenerateResponse]:
        first, self.first = self.first, None
        if first is not None:
            yield first
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            yield msg

    async def _resume(self, cause: grpc.aio.AioRpcError) -> None:
        """Continue on another verifier, or raise the error naming `cause`."""
        self.avoid.add(self.handle.endpoint, self.handle.epoch)
        self.close()
        self.resumes += 1
        request = self.spec.resumed(self.resumes, self.progress).message()
        failover = self.opts.failover
        give_up = time.monotonic() + failover.wait_s
        while True:
            handles = [h for h in self.pool.candidates() if h.info is not None and
                       h.info.continues and self.avoid.allows(h.endpoint, h.epoch)]
            left = self.deadline - time.monotonic()
            opened = await open_on(self.pool, handles, request, self.opts, left) \
                if left > 0 and handles else None
            if isinstance(opened, Opened):
                self.handle, self.call, self.first = opened.handle, opened.call, opened.first
                self._closed = False
                failover.on_resume()
                return
            if time.monotonic() >= min(give_up, self.deadline):
                raise unavailable(f"the verifier failed mid-stream ({cause.code().name}: "
                                  f"{cause.details()}) and no other verifier could resume "
                                  f"the request within {failover.wait_s:g} s",
                                  self.opts.retry_after_s) from None
            await asyncio.sleep(failover.poll_s)

    def close(self) -> None:
        """Cancel the call if it is still running (idempotent, never blocks)."""
        if not self._closed:
            self._closed = True
            self.call.cancel()
            self.pool.release(self.handle)


class PromptOnlyStream:
    """A generation of no tokens (echo with max_tokens 0, as vLLM answers it): it finishes
    with LENGTH at once and no verifier is asked. Reads like a GenerationStream."""

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        stats = pb.RequestStats(prompt_tokens=prompt_tokens)
        self.first = pb.GenerateResponse(request_id=request_id, finished=pb.GenerateFinished(
            reason=pb.FINISH_REASON_LENGTH, stats=stats))

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        yield self.first

    def close(self) -> None:
        pass


async def prompt_only(spec: GenerationSpec, tokenizer: Tokenizer | None,
                      max_model_len: int | None) -> PromptOnlyStream:
    """The PromptOnlyStream of `spec` (a text prompt; `tokenizer` counts its tokens)."""
    if tokenizer is None or not isinstance(spec.prompt, str):
        raise unsupported("max_tokens", "max_tokens = 0 without the model's tokenizer at "
                                        "the gateway (it counts the echoed prompt's tokens)")
    # NOTE: encode releases the GIL (Tokenizer.encode); off the event loop for long texts
    count = len(await asyncio.to_thread(tokenizer.encode, spec.prompt))
    if max_model_len is not None and count > max_model_len:
        raise invalid("prompt", f"{count} prompt tokens do not fit the context of "
                                f"{max_model_len} tokens", "context_length_exceeded")
    return PromptOnlyStream(spec.request_id, count)


async def open_generation(pool: VerifierPool, spec: GenerationSpec, prompt_field: str,
                          timeout_s: float, retry_after_s: int,
                          failover: Failover = DEFAULT_FAILOVER) -> GenerationStream:
    opts = CallOptions(prompt_field, timeout_s, retry_after_s, failover)
    opened = await open_on(pool, pool.candidates(), spec.message(), opts, timeout_s)
    if isinstance(opened, Opened):
        return GenerationStream(pool, spec, opened, opts)
    raise opened or unavailable("no verifier is serving yet; retry shortly", retry_after_s)


async def open_on(pool: VerifierPool, handles: Sequence[VerifierHandle],
                  request: pb.GenerateRequest, opts: CallOptions, timeout_s: float
                  ) -> Opened | APIError | None:
    """The first of `handles` to take `request`, else the error to answer (None: no
    handle); a refusal no other verifier can cure raises it."""
    last: APIError | None = None
    for handle in handles:
        pool.acquire(handle)
        call = handle.stub.Generate(request, timeout=timeout_s)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            pool.release(handle)
            error = from_grpc(e, opts.prompt_field, opts.retry_after_s)
            if error.status not in RETRY_STATUSES:  # NOTE: not every RESOURCE_EXHAUSTED
                raise error from None  # is a full server (413: over gRPC's message limit)
            if e.code() is grpc.StatusCode.UNAVAILABLE:
                pool.mark_unavailable(handle)
            last = error if last is None or last.status != 429 else last
            continue
        except BaseException:  # cancelled while waiting (client gone)
            call.cancel()
            pool.release(handle)
            raise
        if first is grpc.aio.EOF:  # a verifier always ends with `finished`; treat as gone
            pool.release(handle)
            continue
        return Opened(handle, call, first)
    return last

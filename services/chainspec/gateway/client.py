"""One request to the verifiers: build the `GenerateRequest`, pick a verifier, and stream.

`open_generation` tries the serving verifiers least-loaded first and returns once one of
them has sent the first message, so everything that can go wrong before the first token
(bad input, a full or draining verifier) is still an HTTP status. A full
(RESOURCE_EXHAUSTED) or draining/unreachable (UNAVAILABLE) verifier passes the request on
to the next one; when none is left the answer is 429 resp. 503. (gRPC's own message-size
limit is also RESOURCE_EXHAUSTED; that one is 413 at once.) `close()` cancels the
gRPC call, which aborts the request in the verifier and releases it in the drafters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from chainspec.gateway.errors import APIError, from_grpc, invalid, unavailable, unsupported
from chainspec.gateway.routing import VerifierHandle, VerifierPool
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

RETRY_STATUSES = (429, 503)  # a full or draining verifier: the next one may take it


@dataclass(frozen=True)
class Processing:
    """Logits processing and logprobs (verifier.proto SamplingParams 5..11); defaults: off."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None  # alternatives per token; None: no logprobs

    def fill(self, s: pb.SamplingParams) -> None:
        s.presence_penalty, s.frequency_penalty = self.presence_penalty, self.frequency_penalty
        if self.repetition_penalty != 1.0:
            s.repetition_penalty = self.repetition_penalty
        for tok, bias in self.logit_bias:
            s.logit_bias[tok] = bias
        s.min_p, s.min_tokens = self.min_p, self.min_tokens
        if self.logprobs is not None:
            s.logprobs = self.logprobs


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
        return req


class GenerationStream:
    """A Generate call that has produced its first message."""

    def __init__(self, pool: VerifierPool, handle: VerifierHandle, call,
                 first: pb.GenerateResponse, prompt_field: str, retry_after_s: int) -> None:
        self.pool, self.handle, self.call, self.first = pool, handle, call, first
        self.prompt_field, self.retry_after_s = prompt_field, retry_after_s
        self._closed = False

    @property
    def endpoint(self) -> str:
        return self.handle.endpoint

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        """Every message, the first included; a failed call raises APIError."""
        yield self.first
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    return
                yield msg
        except grpc.aio.AioRpcError as e:
            raise from_grpc(e, self.prompt_field, self.retry_after_s) from None

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
                          timeout_s: float, retry_after_s: int) -> GenerationStream:
    request = spec.message()
    last: APIError | None = None
    for handle in pool.candidates():
        pool.acquire(handle)
        call = handle.stub.Generate(request, timeout=timeout_s)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            pool.release(handle)
            error = from_grpc(e, prompt_field, retry_after_s)
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
        return GenerationStream(pool, handle, call, first, prompt_field, retry_after_s)
    raise last or unavailable("no verifier is serving yet; retry shortly", retry_after_s)

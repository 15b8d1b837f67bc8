"""The `Gateway` object the HTTP routes delegate to (the ASGI app around it is built in
`gateway/asgi.py`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.choices import Shape, read_choice, whole_body
from chainspec.gateway.client import (
    GenerationSpec,
    GenerationStream,
    open_generation,
    prompt_only,
)
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.errors import APIError, invalid, overloaded, unavailable
from chainspec.gateway.failover import Failover
from chainspec.gateway.fanout import choice_specs, open_all
from chainspec.gateway.metrics import GatewayMetrics
from chainspec.gateway.responses import Envelope, Format
from chainspec.gateway.routing import VerifierPool
from chainspec.gateway.sse import HEADERS, EventStreamResponse, stream_events
from chainspec.gateway.strict_json import StrictJSONResponse
from chainspec.gateway.token_bytes import token_bytes_of
from chainspec.metrics.discovery import http_sd_groups

CLIENT_GONE = 499  # nginx's code for "the client closed the request"


class Gateway:
    """Admission, model names and the request/response cycle behind the routes.
    `members()`: the stack's members as the membership source knows them (discovery)."""

    def __init__(self, config: GatewayConfig, pool: VerifierPool, chat: ChatTemplate,
                 members: Callable[[], list[dict[str, Any]]] = list) -> None:
        self.config, self.pool, self.chat, self.members = config, pool, chat, members
        self.metrics = GatewayMetrics(config.model_name)
        self.metrics.routing.pool = pool
        self.failover = Failover(on_resume=self.metrics.stream_resumes.inc)  # mid-stream
        self.in_flight = 0
        self.started = int(time.time())
        self.token_bytes = token_bytes_of(chat.tokenizer, chat.token_text)

    def metrics_targets(self) -> list[dict[str, Any]]:
        """Prometheus http_sd target groups: every live member's metrics endpoint."""
        return http_sd_groups(self.members())

    # -- models -------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        if self.config.served_model_name:  # --served-model-name: every name, in order
            return list(self.config.served_model_name) if self.pool.ready else []
        return sorted({info.model_name for info in self.pool.model_infos()})

    def model_cards(self) -> list[dict[str, Any]]:
        """vLLM's ModelCard per served name: `root` the model the verifiers load (their
        name), `parent` None (no adapters), `max_model_len` the longest they take."""
        infos, alias = self.pool.model_infos(), bool(self.config.served_model_name)
        cards = []
        for name in self.model_names():
            mine = sorted((i for i in infos if alias or i.model_name == name),
                          key=lambda i: i.model_name)
            cards.append({"id": name, "object": "model", "created": self.started,
                          "owned_by": "chainspec",
                          "root": mine[0].model_name if mine else name, "parent": None,
                          "max_model_len": max((i.max_model_len for i in mine),
                                               default=None)})
        return cards

    def model_card(self, model_id: str) -> dict[str, Any]:
        """One card, or 404 naming the id and the served ones."""
        for card in self.model_cards():
            if card["id"] == model_id:
                return card
        served = ", ".join(repr(n) for n in self.model_names()) or "none yet"
        raise APIError(404, f"model: {model_id!r} does not exist; this server serves "
                            f"{served}", "invalid_request_error", "model", "model_not_found")

    def request_params(self, body: Any) -> Any:
        """The body with --generation-config's defaults for the fields it leaves unset,
        after --max-logprobs (a 400 naming the field)."""
        unset = {k: v for k, v in self.config.sampling_defaults
                 if k not in body.model_fields_set}
        body = body.model_copy(update=unset) if unset else body
        asked = body.num_logprobs
        if asked is not None and asked > self.config.max_logprobs:
            field = "top_logprobs" if "top_logprobs" in type(body).model_fields else "logprobs"
            raise invalid(field, f"must be <= {self.config.max_logprobs} (--max-logprobs), "
                                 f"got {asked}")
        return body

    def resolve_model(self, requested: str | None) -> str:
        names = self.model_names()
        if not names:
            raise unavailable("no verifier is serving yet; retry shortly",
                              self.config.retry_after_s)
        if requested is None:
            return names[0]
        if requested not in names:
            raise invalid("model", f"unknown model {requested!r}; this server serves "
                                   f"{', '.join(map(repr, names))}", "model_not_found")
        return requested

    @staticmethod
    def new_specs(body: Any, prompt: str | list[int], prefix: str
                  ) -> tuple[str, list[GenerationSpec]]:
        """(response id, one verifier request per choice). `request_id` (vLLM): the
        response id is `<prefix><request_id>`; verifier ids stay unique regardless."""
        unique = uuid.uuid4().hex
        spec = GenerationSpec(f"{prefix}{unique}", prompt, body.output_limit,
                              body.temperature, body.top_p, body.top_k, body.seed,
                              tuple(body.stop), body.ignore_eos, tuple(body.stop_token_ids),
                              body.include_stop_str_in_output, body.processing(),
                              priority=body.priority,
                              num_speculative_tokens=None if body.speculative is None
                              else body.speculative.num_speculative_tokens,
                              cache_salt=body.cache_salt or "")
        response_id = f"{prefix}{body.request_id}" if body.request_id else spec.request_id
        return response_id, choice_specs(spec, body.n)

    # -- one generation -----------------------------------------------------------------
    async def respond(self, request: Request, fmt: type[Format], response_id: str,
                      specs: list[GenerationSpec], body: Any, model: str,
                      shape: Shape) -> Response:
        if len(specs) > self.config.max_n:
            raise invalid("n", f"at most {self.config.max_n} choices per request on this "
                               f"server (--max-n), got {len(specs)}")
        self._admit()
        try:
            streams = await until_disconnected(
                request, open_all(specs, lambda spec: self._open(spec, fmt)))
        except BaseException:
            self._leave()
            raise
        if streams is None:
            self._leave()
            return Response(status_code=CLIENT_GONE)
        env = Envelope(response_id, int(time.time()), model)

        def close() -> None:
            for stream in streams:
                stream.close()
            self._leave()
        if body.stream:
            return EventStreamResponse(
                stream_events(streams, fmt, env, body.include_usage, shape), close,
                media_type="text/event-stream", headers=HEADERS)
        try:
            result = await until_disconnected(request, collect(streams, fmt, env, shape))
        finally:
            close()
        return StrictJSONResponse(result) if result is not None else \
            Response(status_code=CLIENT_GONE)

    async def _open(self, spec: GenerationSpec, fmt: type[Format]) -> GenerationStream:
        if spec.max_tokens == 0:  # echo alone (schemas allow 0 only then): no verifier
            return await prompt_only(spec, self.chat.tokenizer, self.max_model_len())
        return await open_generation(self.pool, spec, fmt.prompt_field,
                                     self.config.request_timeout_s, self.config.retry_after_s,
                                     self.failover)

    def max_model_len(self) -> int | None:
        return max((i.max_model_len for i in self.pool.model_infos()), default=None) or None

    def _admit(self) -> None:
        if self.in_flight >= self.config.max_in_flight:
            raise overloaded(f"the gateway has {self.in_flight} requests in flight, its limit",
                             self.config.retry_after_s)
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

    def _leave(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)


async def collect(streams: list[GenerationStream], fmt: type[Format], env: Envelope,
                  shape: Shape) -> dict:
    """A whole non-streamed response of every choice."""
    tasks = [asyncio.ensure_future(read_choice(i, s)) for i, s in enumerate(streams)]
    try:
        states = await asyncio.gather(*tasks)
    finally:  # one choice failed or the client left: stop reading the others
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return whole_body(fmt, env, shape, states)


async def until_disconnected(request: Request, coro) -> Any:
    """`coro`'s result, or None (coro cancelled) if the client goes away first. The
    request body must have been read already."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

"""The HTTP routes: thin -- check the key, parse, delegate to the `Gateway`."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from chainspec.gateway import structured_output
from chainspec.gateway.app import Gateway
from chainspec.gateway.auth import check_api_key
from chainspec.gateway.body import read_json
from chainspec.gateway.chat_template import Turn
from chainspec.gateway.choices import Shape
from chainspec.gateway.responses import ChatFormat, CompletionFormat
from chainspec.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
from chainspec.gateway.tokenize import detokenize, parse_detokenize, parse_tokenize, tokenize
from chainspec.version import chainspec_version

router = APIRouter()


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    check_api_key(request.headers, gateway.config.api_key)
    return gateway


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    gateway = _gateway(request)
    body = gateway.request_params(parse(CompletionRequest, await read_json(request)))
    await structured_output.check(body.grammar_spec())
    prompt = body.prompt_value()
    model = gateway.resolve_model(body.model)
    response_id, specs = gateway.new_specs(body, prompt, "cmpl-")
    shape = shape_of(gateway, body, prompt if body.echo else "")
    return await gateway.respond(request, CompletionFormat, response_id, specs, body, model,
                                 shape)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    gateway = _gateway(request)
    body = gateway.request_params(parse(ChatCompletionRequest, await read_json(request)))
    await structured_output.check(body.grammar_spec())
    prompt = await gateway.chat.render(
        [Turn(m.role, m.text()) for m in body.messages], body.generation_prompt,
        body.continue_final_message, body.chat_template_kwargs, body.chat_template,
        trust_template=gateway.config.trust_request_chat_template)
    model = gateway.resolve_model(body.model)
    response_id, specs = gateway.new_specs(body, prompt, "chatcmpl-")
    return await gateway.respond(request, ChatFormat, response_id, specs, body, model,
                                 shape_of(gateway, body, body.echo_text))


def shape_of(gateway: Gateway, body, echo: str) -> Shape:
    return Shape(echo, body.num_logprobs is not None, gateway.chat.token_text,
                 gateway.token_bytes)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": _gateway(request).model_cards()})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> JSONResponse:
    return JSONResponse(_gateway(request).model_card(model_id))


@router.post("/tokenize")
async def tokenize_route(request: Request) -> JSONResponse:
    gateway = _gateway(request)
    body = parse_tokenize(await read_json(request))
    if body.model is not None:
        gateway.resolve_model(body.model)
    return JSONResponse(await tokenize(gateway.chat, body, gateway.max_model_len(),
                                       gateway.config.trust_request_chat_template))


@router.post("/detokenize")
async def detokenize_route(request: Request) -> JSONResponse:
    gateway = _gateway(request)
    body = parse_detokenize(await read_json(request))
    if body.model is not None:
        gateway.resolve_model(body.model)
    return JSONResponse(detokenize(gateway.chat, body))


@router.get("/version")
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": chainspec_version()})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once a verifier serves, else 503. `drafters`: the most drafters any serving
    verifier is connected to; `speculative`: whether any verifier drafts."""
    gateway: Gateway = request.app.state.gateway
    views = gateway.pool.views()
    serving = [v for v in views if v.serving]
    drafters = max((v.drafters for v in serving), default=0)
    body = {"status": "ok" if serving else "unavailable", "verifiers": len(serving),
            "drafters": drafters, "speculative": drafters > 0,
            "in_flight": gateway.in_flight,
            "members": [asdict(v) for v in views]}
    return JSONResponse(body, 200 if serving else 503)


@router.get("/v1/metrics/targets")
async def metrics_targets(request: Request) -> JSONResponse:
    """Prometheus HTTP service discovery: `http_sd_configs: [{url: <gateway>/v1/metrics/
    targets}]` finds every member's metrics endpoint as members come and go."""
    return JSONResponse(_gateway(request).metrics_targets())


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gateway = request.app.state.gateway
    await gateway.metrics.stack.refresh(gateway.members())  # the verifiers' vllm: sums
    content, media_type = gateway.metrics.exposition()
    return Response(content, media_type=media_type)

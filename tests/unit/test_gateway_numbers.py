"""Numbers at the door and on the way out (issue 19): every float sampling parameter is
bounded where the engine's arithmetic stays finite (a 400 naming the parameter and the
bound; denormals refused; temperature below 1e-5 greedy), the verifier's codec and
SamplingParams hold the same line, logprobs are finite whatever the logits, and the
gateway's JSON and SSE encoders refuse non-finite floats with a clean error. Plus the
small contract gaps: logit_bias naming a token twice, `response_format: {}`, a declared
charset, CR/LF in request_id, echo with max_tokens 0."""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import httpx
import pytest
import torch

from chainspec.engine.logits_processors import LogitsProcessing, WindowRequest
from chainspec.engine.logprobs import LOGPROB_FLOOR, window_logprobs
from chainspec.engine.sampling import SamplingParams
from chainspec.gateway.app import Gateway
from chainspec.gateway.asgi import build_app
from chainspec.gateway.body import check_content_type, decode
from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.errors import APIError
from chainspec.gateway.routing import VerifierPool
from chainspec.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
from chainspec.gateway.sse import event
from chainspec.rpc.codec import WireError
from chainspec.rpc.generate_codec import GenerateLimits, parse_generate
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

TINY = 2.0 ** -126
CMPL = {"prompt": "x", "max_tokens": 2}


def refusal(body: dict, model=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as e:
        parse(model, {**CMPL, **body} if model is CompletionRequest else body)
    assert e.value.status == 400 and e.value.message.startswith(f"{e.value.param}: ")
    return e.value


# ------------------------------------------------------------------------- the door


@pytest.mark.parametrize("name,bad,bound", [
    ("repetition_penalty", 1e-40, "0.01"),  # the red-team repro
    ("repetition_penalty", 0.0099, "0.01"),
    ("repetition_penalty", 101.0, "100"),
    ("temperature", 2.0001, "2"),
    ("temperature", -1e-45, "0"),
    ("top_p", 0.0, "0"),
    ("top_p", 1.0000001, "1"),
    ("min_p", 1.5, "1"),
    ("presence_penalty", -2.5, "-2"),
    ("frequency_penalty", 1e300, "2"),
])
def test_out_of_range_names_parameter_and_bound(name, bad, bound) -> None:
    e = refusal({name: bad})
    assert e.param == name and bound in e.message, e.message


@pytest.mark.parametrize("name", ["top_p", "min_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("denormal", [1e-40, 5e-324, 1.1754942e-38])
def test_denormals_are_refused(name, denormal) -> None:
    for value in (denormal, -denormal) if "penalty" in name else (denormal,):
        e = refusal({name: value})
        assert e.param == name and "1.1754944e-38" in e.message, e.message


def test_logit_bias_values_denormal_or_out_of_range() -> None:
    assert refusal({"logit_bias": {"3": 1e-40}}).param == "logit_bias.3"
    assert refusal({"logit_bias": {"3": -100.5}}).param == "logit_bias.3"
    ok = parse(CompletionRequest, {**CMPL, "logit_bias": {"3": TINY, "4": -100}})
    assert ok.processing().logit_bias == ((3, TINY), (4, -100))


@pytest.mark.parametrize("value,greedy", [(0, True), (5e-324, True), (1e-45, True),
                                          (9.99e-6, True), (1e-5, False), (0.5, False)])
def test_temperature_below_1e5_is_greedy(value, greedy) -> None:
    t = parse(CompletionRequest, {**CMPL, "temperature": value}).temperature
    assert (t == 0.0) == greedy and (greedy or t == value)
    assert SamplingParams(temperature=value).greedy == greedy  # the engine's own rule


def test_normal_edges_are_accepted() -> None:
    r = parse(CompletionRequest, {**CMPL, "top_p": TINY, "min_p": TINY, "presence_penalty":
                                  -TINY, "frequency_penalty": 2, "repetition_penalty": 0.01})
    assert (r.top_p, r.min_p, r.repetition_penalty) == (TINY, TINY, 0.01)
    assert parse(CompletionRequest, {**CMPL, "repetition_penalty": 100}).repetition_penalty == 100


# --------------------------------------------------------------------- the verifier


LIMITS = GenerateLimits(vocab_size=64, max_len=128, num_steps=3)


@pytest.mark.parametrize("field,value,path", [
    ("repetition_penalty", 1e-40, "sampling.repetition_penalty"),
    ("repetition_penalty", 1e6, "sampling.repetition_penalty"),
    ("top_p", 1e-40, "sampling.top_p"),
    ("min_p", 1e-40, "sampling.min_p"),
    ("presence_penalty", -1e-40, "sampling.presence_penalty"),
])
def test_codec_holds_the_same_line(field, value, path) -> None:
    req = pb.GenerateRequest(tokens=pb.PromptTokens(ids=[1, 2]))
    setattr(req.sampling, field, value)
    with pytest.raises(WireError) as e:
        parse_generate(req, LIMITS, None)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith(f"{path}: "), e.value.message


def test_codec_tiny_temperature_and_bias_denormal() -> None:
    req = pb.GenerateRequest(tokens=pb.PromptTokens(ids=[1, 2]))
    req.sampling.temperature = 1e-45  # a float32 denormal on the wire
    assert parse_generate(req, LIMITS, None).sampling.greedy
    req.sampling.logit_bias[3] = 1e-40
    with pytest.raises(WireError, match=r"sampling\.logit_bias\[3\]"):
        parse_generate(req, LIMITS, None)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-40)


# ------------------------------------------------------------------- finite outputs


def test_window_logprobs_are_finite_whatever_the_logits() -> None:
    logits = torch.randn(2, 3, 8)
    logits[0, 0, 2] = -math.inf  # masked (min_tokens)
    logits[0, 1, :] = -math.inf  # a whole row masked
    logits[1, 0, 4] = math.nan
    logits[1, 1, 5] = math.inf
    drafts = torch.tensor([[2, 1], [4, 5]])
    w = window_logprobs(logits, drafts, torch.tensor([2, 2]), torch.tensor([0, 0]), 8)
    for t in (w.chosen, w.top_values):
        assert torch.isfinite(t).all() and (t >= LOGPROB_FLOOR).all() and (t <= 0).all()
    assert w.chosen[0, 0] == LOGPROB_FLOOR  # -inf -> vLLM's -9999.0
    plain = window_logprobs(logits[:, 2:], drafts[:, :0], torch.tensor([0, 0]),
                            torch.tensor([3, 3]), 2)
    assert torch.allclose(plain.chosen[:, 0], logits[:, 2].log_softmax(-1)[:, 3])


def test_processed_logits_carry_no_nan_or_inf() -> None:
    p = SamplingParams(temperature=0.0, repetition_penalty=0.01)
    proc = LogitsProcessing.build([WindowRequest(p, [1, 2], [3])], 8, "cpu")
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, 1] = 3.4e38  # seen, positive: / 0.01 overflows float32
    logits[0, 1, 6] = math.nan
    out = proc.apply(logits, torch.tensor([[5]]), torch.tensor([1]))
    assert not out.isnan().any() and not out.isposinf().any()
    assert out[0, 0].argmax() == 1 and out[0, 1, 6] == -math.inf


# ------------------------------------------------------------------ strict encoders


def test_sse_event_refuses_nan() -> None:
    assert event({"x": 1.5}) == 'data: {"x":1.5}\n\n'
    with pytest.raises(APIError) as e:
        event({"x": [math.nan]})
    assert e.value.status == 500 and e.value.code == "non_finite_number"


class NaNCall:
    """A verifier stream whose one token has a NaN logprob (a server bug)."""

    def __init__(self) -> None:
        lp = pb.TokenLogprob(token_id=7, logprob=math.nan)
        self._messages = [
            pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[7], text="ok", logprobs=[lp])),
            pb.GenerateResponse(finished=pb.GenerateFinished(
                reason=pb.FINISH_REASON_LENGTH, stats=pb.RequestStats(prompt_tokens=1)))]

    async def read(self):
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> None:
        pass


class NaNVerifier:
    endpoint, serving, in_flight, retired, load = "fake:1", True, 0, False, 0

    def __init__(self) -> None:
        self.stub = type("Stub", (), {"Generate": lambda _, req, timeout: NaNCall()})()
        self.info = pb.VerifierInfo(model_name="tiny", max_model_len=512)


def post(body: dict) -> httpx.Response:
    pool = VerifierPool()
    pool.handles["fake:1"] = NaNVerifier()
    app = build_app(Gateway(GatewayConfig(), pool, ChatTemplate()))

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            return await client.post("/v1/completions", json=body)
    return asyncio.run(go())


def strict(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))


def test_non_finite_response_is_a_clean_error() -> None:
    r = post({"prompt": "x", "max_tokens": 1, "logprobs": 0})
    assert r.status_code == 500 and strict(r.text)["error"]["code"] == "non_finite_number"
    r = post({"prompt": "x", "max_tokens": 1, "logprobs": 0, "stream": True})
    events = [strict(b.removeprefix("data: ")) for b in r.text.split("\n\n") if b]
    assert r.status_code == 200 and events[-1]["error"]["code"] == "non_finite_number"
    assert "[DONE]" not in r.text


# -------------------------------------------------------------- small contract gaps


def test_logit_bias_naming_a_token_twice() -> None:
    e = refusal({"logit_bias": {"5": 1.0, "05": 2.0}})
    assert e.param == "logit_bias.05" and "token 5" in e.message and "'5'" in e.message


def test_response_format_needs_a_type() -> None:
    assert refusal({"response_format": {}}).param == "response_format.type"
    assert refusal({"response_format": {"type": "json"}}).param == "response_format.type"
    parse(CompletionRequest, {**CMPL, "response_format": {"type": "text"}})


@pytest.mark.parametrize("request_id", ["a\r\nSet-Cookie: x", "a\nb", "a\rb", "a\x00b",
                                        "a\u2028b", "a\tb"])
def test_request_id_with_control_characters(request_id) -> None:
    e = refusal({"request_id": request_id})
    assert e.param == "request_id" and "control" in e.message
    assert parse(CompletionRequest, {**CMPL, "request_id": "job-7 try:2"}).request_id


def test_max_tokens_0_only_with_echo() -> None:
    r = parse(CompletionRequest, {"prompt": "x", "echo": True, "max_tokens": 0})
    assert r.output_limit == 0 and r.prompt_only
    assert refusal({"max_tokens": 0}).param == "max_tokens"
    chat = {"messages": [{"role": "assistant", "content": "x"}], "echo": True,
            "max_tokens": 0}
    assert refusal(chat, ChatCompletionRequest).param == "max_tokens"
    assert refusal({"echo": True, "max_tokens": 0, "min_tokens": 1}).param == "min_tokens"


@pytest.mark.parametrize("content_type,charset", [
    (None, "utf-8"), ("application/json", "utf-8"),
    ("application/json; charset=latin-1", "iso8859-1"),
    ('application/json; Charset="ISO-8859-1"', "iso8859-1"),
    ("application/json;charset=UTF-16LE", "utf-16-le"),
    ("application/json; charset=windows-1252", "cp1252"),
])
def test_declared_charset_is_honoured(content_type, charset) -> None:
    assert check_content_type(content_type) == charset
    text = '{"prompt": "caf\u00e9"}'
    assert decode(text.encode(charset), charset) == {"prompt": "caf\u00e9"}


@pytest.mark.parametrize("charset", ["utf-7", "unicode_escape", "rot13", "klingon"])
def test_unsupported_charset_is_415_naming_it(charset) -> None:
    with pytest.raises(APIError) as e:
        check_content_type(f"application/json; charset={charset}")
    assert e.value.status == 415 and repr(charset) in e.value.message

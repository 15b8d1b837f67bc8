"""No HTTP body yields a 5xx: generated bodies (valid and invalid shapes, wrong types, huge
ints, deep nesting, lone surrogates, NaN, random field names and content types) go
through the gateway's ASGI app in-process, over a fake verifier that serializes each
GenerateRequest as the channel would. Every answer is 200, 400, 413 or 415, and every
error is an OpenAI-style JSON body."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chainspec.gateway.app import Gateway
from chainspec.gateway.asgi import build_app
from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.routing import VerifierPool
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.training.bpe import CHAT_TEMPLATE

MAX_BODY = 256 * 1024
EXAMPLES = 2000
ANSWERS = {200, 400, 413, 415}


# ------------------------------------------------------------------- the fake verifier


class FakeCall:
    """A Generate stream: one chunk, then `finished`."""

    def __init__(self) -> None:
        stats = pb.RequestStats(prompt_tokens=3, completion_tokens=1, rounds=1)
        self._messages = [
            pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=[7], text="ok")),
            pb.GenerateResponse(finished=pb.GenerateFinished(
                reason=pb.FINISH_REASON_LENGTH, stats=stats))]

    async def read(self):
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> None:
        pass


class FakeStub:
    def Generate(self, request: pb.GenerateRequest, timeout: float) -> FakeCall:  # noqa: N802
        request.SerializeToString()  # what the channel does
        return FakeCall()


class FakeVerifier:
    """Stands in for a `VerifierHandle`: always serving, never loaded."""

    endpoint, serving, in_flight, retired, load = "fake:1", True, 0, False, 0

    def __init__(self) -> None:
        self.stub = FakeStub()
        self.info = pb.VerifierInfo(model_name="tiny", max_model_len=512)


@pytest.fixture(scope="module")
def gateway():
    """(event loop, httpx client on the app in-process)."""
    pool = VerifierPool()
    pool.handles["fake:1"] = FakeVerifier()
    chat = ChatTemplate(CHAT_TEMPLATE)  # the demo model's
    app = build_app(Gateway(GatewayConfig(max_body_bytes=MAX_BODY), pool, chat))
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    yield loop, client
    loop.run_until_complete(client.aclose())
    loop.close()
    chat.close()


# ------------------------------------------------------------------------- the bodies


@dataclass(frozen=True)
class Raw:
    """JSON text put into a body as is (what json.dumps cannot write)."""

    text: str


def dump(value, ascii: bool) -> str:
    """JSON text; `ascii`: non-ASCII as \\u escapes, else as itself (a lone surrogate then
    becomes bytes that are not UTF-8)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k, ensure_ascii=ascii)}:{dump(v, ascii)}"
                              for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v, ascii) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii)


surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(max_size=12) | st.text(st.characters() | surrogate, min_size=1, max_size=6)
edges = [0, 1, -1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 63, 2 ** 64 - 1, 2 ** 64, 10 ** 20]
numbers = (st.integers() | st.sampled_from(edges) | st.integers(-2 ** 70, 2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False))
raw = st.one_of(
    st.integers(21, 6000).map(lambda n: Raw("9" * n)),  # beyond Python's int() digits
    st.integers(2, 120_000).map(lambda n: Raw("[" * n + "]" * n)),  # deep nesting
    st.integers(2, 200).map(lambda n: Raw('{"a":' * n + "1" + "}" * n)),
    st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999")]),
    st.integers(1, 2 * MAX_BODY).map(lambda n: Raw(json.dumps("x" * n))),  # maybe too large
)
scalars = st.none() | st.booleans() | numbers | texts | st.sampled_from(
    ["yes", "true", "1", "user", "text", "none", "auto"])
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(texts, inner, max_size=4), max_leaves=8) | raw

COMMON = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "stream", "stream_options", "ignore_eos", "presence_penalty", "frequency_penalty",
          "logit_bias", "user"]
COMPLETION_FIELDS = [*COMMON, "prompt", "echo", "suffix", "logprobs", "best_of"]
CHAT_FIELDS = [*COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
               "tools", "tool_choice", "functions", "response_format"]


def field_values(names: list[str]):
    """{field: value} with known and random field names."""
    return st.dictionaries(st.sampled_from(names) | texts, values, max_size=4)


# Mostly valid bodies (the mutations below and `values` bring the bad shapes).
good_text = st.text(min_size=1, max_size=12)
counts = st.integers(1, 2 ** 32 - 1)
stops = st.none() | good_text | st.lists(good_text, max_size=3)
valid_completion = st.fixed_dictionaries(
    {"prompt": good_text | st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=5)},
    optional={"max_tokens": counts, "stream": st.booleans(), "stop": stops,
              "top_k": counts, "seed": st.integers(0, 2 ** 64 - 1),
              "temperature": st.floats(0, 2)})
part = st.fixed_dictionaries({"type": st.just("text"), "text": good_text})
good_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": good_text | st.lists(part, max_size=3)})
bad_message = st.dictionaries(st.sampled_from(["role", "content", "name", "type"]) | texts,
                              values | st.just("tool") | st.lists(part | values),
                              max_size=3)
message = st.one_of(good_message, good_message, good_message, bad_message)
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(message, min_size=1, max_size=3)},
    optional={"max_completion_tokens": counts, "max_tokens": counts,
              "stream": st.booleans(), "stop": stops})
content_types = st.sampled_from(["application/json"] * 8 + [
    "application/json; charset=utf-8", "application/vnd.api+json", None, "text/plain",
    "application/x-www-form-urlencoded", "multipart/form-data", "", "application/jsonx"])


def bodies(valid, names: list[str]):
    """Request bytes: a mostly valid body with fields replaced or added, a random JSON
    value, or random bytes."""
    mixed = st.builds(lambda body, extra: {**body, **extra}, valid, field_values(names))
    as_text = st.builds(dump, st.one_of(mixed, valid, values), ascii=st.booleans())
    return as_text.map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=64)


# -------------------------------------------------------------------------- the property


def check_answer(response: httpx.Response) -> int:
    assert response.status_code in ANSWERS, (response.status_code, response.text[:300])
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n"), response.text[-300:]
        else:
            assert response.json()["choices"][0]["finish_reason"] == "length"
        return 200
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    if error["param"] is not None:
        assert error["message"].startswith(f"{error['param']}: ")
    return response.status_code


def post(gateway, path: str, body: bytes, content_type: str | None,
         chunked: bool) -> httpx.Response:
    """`chunked`: the body in 64 KiB pieces without a Content-Length."""
    loop, client = gateway
    headers = {} if content_type is None else {"content-type": content_type}

    async def pieces():
        for i in range(0, len(body), 2 ** 16):
            yield body[i:i + 2 ** 16]
    content = pieces() if chunked else body
    return loop.run_until_complete(client.post(path, content=content, headers=headers))


def never_5xx(gateway, path: str, strategy) -> Counter:
    """Runs the property over EXAMPLES bodies; the statuses seen."""
    seen: Counter = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=strategy, content_type=content_types, chunked=st.booleans())
    def one(body: bytes, content_type: str | None, chunked: bool) -> None:
        seen[check_answer(post(gateway, path, body, content_type, chunked))] += 1
    one()
    return seen


# NOTE: a generator that only made bad bodies would pass vacuously: each run must also
# see a fair share of requests that reach the (fake) verifier and every refusal kind.
def test_completions_never_5xx(gateway) -> None:
    seen = never_5xx(gateway, "/v1/completions", bodies(valid_completion, COMPLETION_FIELDS))
    assert set(seen) == ANSWERS and seen[200] >= EXAMPLES // 20, seen


def test_chat_never_5xx(gateway) -> None:
    seen = never_5xx(gateway, "/v1/chat/completions", bodies(valid_chat, CHAT_FIELDS))
    assert set(seen) == ANSWERS and seen[200] >= EXAMPLES // 20, seen

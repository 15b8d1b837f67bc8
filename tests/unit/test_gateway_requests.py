"""Gateway request handling without servers: JSON bodies within bounds, body validation
naming the field, what is refused as unsupported, the verifier's field paths mapped to
HTTP names, chat templates, the API key check, usage with speculative statistics, and SSE
events."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from chainspec.gateway.auth import check_api_key
from chainspec.gateway.body import MAX_DEPTH, check_content_type, decode
from chainspec.gateway.chat_template import ChatTemplate, Turn
from chainspec.gateway.client import GenerationSpec
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.errors import APIError, from_grpc, http_param
from chainspec.gateway.responses import ChatFormat, Envelope, chunk_body, usage
from chainspec.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
from chainspec.gateway.sse import event
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.integration.tiny_checkpoint import write_tokenizer

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def error_of(model, body) -> APIError:
    with pytest.raises(APIError) as e:
        request = parse(model, body)
        if model is CompletionRequest:
            request.prompt_value()
    assert e.value.status == 400
    assert e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


def object_of_depth(depth: int) -> str:
    """A JSON object nested `depth` levels deep, the object itself the first."""
    return '{"x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


@pytest.mark.parametrize("raw,param,says", [
    ('{"prompt": "a\\ud800b"}', "prompt", "lone surrogate '\\ud800' at index 1"),
    ('{"stop": ["ok", "\\udc00"]}', "stop[1]", "lone surrogate"),
    ('{"messages": [{"content": [{"text": "\\ud83d"}]}]}', "messages[0].content[0].text",
     "lone surrogate"),
    ('{"\\ud800": 1}', "\\ud800", "lone surrogate"),  # a field name, shown escaped
    (object_of_depth(MAX_DEPTH + 1), "x", f"more than {MAX_DEPTH} levels"),
    ("[" * 100_000 + "]" * 100_000, None, f"more than {MAX_DEPTH} levels"),
    ('{"max_tokens": NaN}', None, "NaN is not a JSON number"),
    ('{"top_p": -Infinity}', None, "-Infinity is not a JSON number"),
    ('{"prompt": "x",}', None, "not valid JSON"),
])
def test_bodies_out_of_bounds_are_400(raw, param, says) -> None:
    with pytest.raises(APIError) as e:
        decode(raw.encode())
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert says in e.value.message
    json.dumps(e.value.body()).encode("utf-8")  # always encodable, surrogates or not


def test_bodies_within_bounds_decode() -> None:
    assert MAX_DEPTH == 64 and isinstance(decode(object_of_depth(MAX_DEPTH).encode()), dict)
    pair = '{"prompt": "\\ud83d\\ude00 caf\u00e9"}'  # an escaped surrogate pair is text
    assert decode(pair.encode()) == {"prompt": "\U0001f600 café"}
    # beyond 20 digits (uint64) an integer reads as a float: no int field takes it
    assert decode(b'{"n": ' + b"9" * 5000 + b"}") == {"n": float("inf")}
    assert decode(b"[18446744073709551615, 1e999]") == [2 ** 64 - 1, float("inf")]
    with pytest.raises(APIError) as e:
        decode(b'{"prompt": "\xed\xa0\x80"}')  # a surrogate encoded in the bytes
    assert "not UTF-8" in e.value.message


@pytest.mark.parametrize("content_type,ok", [
    (None, True), ("application/json", True), ("Application/JSON; charset=utf-8", True),
    ("application/vnd.api+json", True), ("text/plain", False), ("", False),
    ("application/x-www-form-urlencoded", False), ("application/jsonl", False),
])
def test_content_type(content_type, ok) -> None:
    if ok:
        check_content_type(content_type)
        return
    with pytest.raises(APIError) as e:
        check_content_type(content_type)
    assert e.value.status == 415 and e.value.code == "unsupported_media_type"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 2 ** 32}, "max_tokens"),  # uint32 on the wire
    ({"prompt": "x", "top_k": 2 ** 32}, "top_k"),
    ({"prompt": "x", "seed": 2 ** 64}, "seed"),  # uint64
    ({"prompt": "x", "max_tokens": float("inf")}, "max_tokens"),  # a 5,000-digit integer
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),  # strict types
    ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream": 1}, "stream"),
    ({"prompt": "x", "ignore_eos": "true"}, "ignore_eos"),
    ({"prompt": "x", "echo": 0}, "echo"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}},
     "stream_options.include_usage"),
    ({"prompt": [1, 2 ** 32]}, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "n": 257}, "n"),  # the schema's bound (--max-n caps n below it)
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "unknown_field": 1}, "unknown_field"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": [5, 6], "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "logit_bias": {"a": 2.0}}, "logit_bias.a"),
    ({"prompt": "x", "logit_bias": {"1": 200.0}}, "logit_bias.1"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": 12}, "prompt"),
])
def test_completion_errors_name_the_field(body, param) -> None:
    err = error_of(CompletionRequest, body)
    assert err.param == param
    assert err.message.startswith(f"{param}: ")


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}, "messages[1].role"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "max_completion_tokens": 2 ** 32}, "max_completion_tokens"),
    ({**CHAT, "stream": "true"}, "stream"),
    ({**CHAT, "logprobs": "no"}, "logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    # fields inside a message are checked too: none is dropped silently
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "a"}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]},
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]},
     "messages[0].content[0].cache_control"),
])
def test_chat_errors_name_the_field(body, param) -> None:
    assert error_of(ChatCompletionRequest, body).param == param


def test_valid_requests_and_defaults() -> None:
    r = parse(CompletionRequest, {"prompt": ["only one"], "stop": "\n", "user": "u"})
    assert r.prompt_value() == "only one" and r.stop == ["\n"]
    assert (r.temperature, r.top_p, r.output_limit) == (1.0, 1.0, 16)  # OpenAI's defaults
    assert parse(CompletionRequest, {"prompt": [[5, 6]]}).prompt_value() == [5, 6]
    chat = parse(ChatCompletionRequest, {
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 9, "max_completion_tokens": 7, "stream": True,
        "stream_options": {"include_usage": True}})
    assert [m.text() for m in chat.messages] == ["be brief", "ab"]
    assert chat.output_limit == 7 and chat.include_usage
    # unset: the largest wire value, which the verifier clamps to the context left (vLLM)
    assert parse(ChatCompletionRequest, CHAT).output_limit == 2 ** 32 - 1


def test_largest_wire_values_convert() -> None:
    """The schema's bounds are the wire's: the largest accepted values fit the proto."""
    r = parse(CompletionRequest, {"prompt": [2 ** 32 - 1], "max_tokens": 2 ** 32 - 1,
                                  "top_k": 2 ** 32 - 1, "seed": 2 ** 64 - 1})
    msg = GenerationSpec("id", r.prompt_value(), r.output_limit, 1, 1, r.top_k, r.seed, (),
                         False).message()
    assert (msg.stop.max_tokens, msg.sampling.top_k) == (2 ** 32 - 1, 2 ** 32 - 1)


def test_spec_becomes_generate_request() -> None:
    spec = GenerationSpec("id1", [3, 4], None, 0.5, 0.9, -1, 2 ** 64 - 1, ("x",), True)
    msg = spec.message()
    assert list(msg.tokens.ids) == [3, 4] and msg.stop.max_tokens == 0
    assert msg.sampling.top_k == 0 and msg.sampling.seed == 2 ** 64 - 1
    assert not GenerationSpec("id2", "t", 5, 0, 1, 0, None, (), False).message() \
        .sampling.HasField("seed")


@pytest.mark.parametrize("wire,prompt_field,param", [
    ("prompt.text: 300 prompt tokens do not fit", "messages", "messages"),
    ("prompt.tokens.ids[1]: token id 900 >= vocab size 300", "prompt", "prompt"),
    ("sampling.top_p: must be in [0, 1]", "prompt", "top_p"),
    ("stop.stop[1]: stop strings must be non-empty", "prompt", "stop"),
    ("something else entirely", "prompt", None),
])
def test_verifier_field_paths_map_to_http_names(wire, prompt_field, param) -> None:
    assert http_param(wire, prompt_field)[0] == param


class _Status(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code,status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAUTHENTICATED, 401),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500),
])
def test_grpc_status_mapping(code, status) -> None:
    err = from_grpc(_Status(code, "prompt.text: 300 prompt tokens do not fit the context"),
                    "prompt", retry_after_s=2)
    assert err.status == status
    if status in (429, 503):
        assert err.headers["Retry-After"] == "2"
    if status == 400:
        assert err.param == "prompt" and err.code == "context_length_exceeded"
        assert err.message.startswith("prompt: 300 prompt tokens")


def test_grpc_message_limit_is_413_not_429() -> None:
    """gRPC's own size limit also says RESOURCE_EXHAUSTED, but no retry can succeed."""
    err = from_grpc(_Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            "CLIENT: Sent message larger than max (70000060 vs. 67108864)"),
                    "prompt", retry_after_s=2)
    assert (err.status, err.code, err.headers) == (413, "request_too_large", {})


def test_error_bodies_always_encode() -> None:
    err = APIError(400, "model: unknown model '\ud800'", "invalid_request_error", "\udfff")
    assert err.param == "\\udfff" and err.message == "model: unknown model '\\ud800'"
    json.dumps(err.body(), ensure_ascii=False).encode("utf-8")


def test_body_limit_config() -> None:
    assert GatewayConfig().max_body_bytes == 8 * 2 ** 20
    assert GatewayConfig.from_dict({"max_body_bytes": 4096}).max_body_bytes == 4096
    with pytest.raises(ValueError, match="max_body_bytes"):
        GatewayConfig(max_body_bytes=10)


def test_api_key() -> None:
    check_api_key({}, None)
    check_api_key({"authorization": "Bearer sk-1"}, "sk-1")
    for headers in ({}, {"authorization": "Bearer sk-2"}, {"authorization": "Basic sk-1"}):
        with pytest.raises(APIError) as e:
            check_api_key(headers, "sk-1")
        assert e.value.status == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"


def test_model_chat_template(tmp_path) -> None:
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                "{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    t = ChatTemplate(template, {"bos_token": "<s>"})

    async def both() -> str:
        try:
            assert await t.render([Turn("user", "hi")]) == "<s>[user]hi[assistant]"
            await t.render([Turn("tool", "x")])
        finally:
            t.close()
    with pytest.raises(APIError) as e:
        asyncio.run(both())
    assert e.value.param == "messages" and "no tools" in e.value.message
    assert "the server's chat template" in e.value.message
    assert ChatTemplate.from_model_dir(None).source is None


def test_model_dir_template(tmp_path) -> None:
    d = tmp_path / "m"
    write_tokenizer(d, 300)
    assert ChatTemplate.from_model_dir(d).source is None
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<e>"}}))
    t = ChatTemplate.from_model_dir(d)
    assert asyncio.run(t.render([Turn("user", "x")])) == "x!"
    assert t.special_tokens == {"eos_token": "<e>"}
    t.close()


def test_usage_and_chunks() -> None:
    stats = pb.RequestStats(prompt_tokens=5, completion_tokens=10, rounds=5, draft_tokens=12,
                            accepted_tokens=6, accepted_per_position=[3, 2, 1],
                            fallback_rounds=1)
    u = usage(stats)
    assert u["total_tokens"] == 15
    assert u["speculative"]["acceptance_length"] == 2.5  # 1 + 6 accepted / 4 drafted rounds
    assert usage(pb.RequestStats(rounds=3, fallback_rounds=3))["speculative"][
        "acceptance_length"] == 1.0
    env = Envelope("chatcmpl-1", 7, "m")
    body = chunk_body(ChatFormat, env, [ChatFormat.delta("a", None)], with_usage=True)
    assert body["usage"] is None and body["object"] == "chat.completion.chunk"
    line = event(body)
    assert line.startswith("data: {") and line.endswith("}\n\n")
    assert json.loads(line[len("data: "):])["choices"][0]["delta"] == {"content": "a"}

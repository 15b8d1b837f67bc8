"""vLLM's side endpoints and response details over a real drafter + verifier + gateway
(the gateway holding the model's tokenizer): `/v1/models` cards with `root`, `parent`
and `max_model_len`, `GET /v1/models/{id}`, `/tokenize`, `/detokenize`, `/version`,
chat's default `max_tokens` (the rest of the context) and logprobs' raw `bytes`.
Every body is validated with the `openai` package's own types where they exist."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion

from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.membership import StaticVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.gateway.token_bytes import TokenBytes
from chainspec.models.tokenizer import Tokenizer
from chainspec.version import chainspec_version
from tests.integration.test_gateway import AUTH, KEY, MAX_LEN, K, error, stack  # noqa: F401
from tests.integration.tiny_checkpoint import chat_prompt

pytestmark = pytest.mark.timeout(300)
CONTEXT = MAX_LEN - 1 - K  # what the verifier reports as max_model_len
PROMPT = "The quick brown fox, 你好"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def url(stack, model_dir):  # noqa: F811
    config = GatewayConfig(port=0, refresh_interval_s=0.2, api_key=KEY)
    gateway = stack.loop.run(GatewayServer.start(config, StaticVerifiers(
        [stack.verifier.address]), ChatTemplate.from_model_dir(model_dir)))
    assert stack.loop.run(gateway.wait_ready(30, drafters=1))
    yield gateway.url
    stack.loop.run(gateway.stop())


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def get(url: str, path: str) -> httpx.Response:
    return httpx.get(f"{url}{path}", headers=AUTH, timeout=30)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)


def test_models_list_and_retrieve(url, client, stack) -> None:  # noqa: F811
    listed = get(url, "/v1/models").json()["data"]
    cards = [Model.model_validate(m) for m in listed]
    assert [(c.id, c.owned_by) for c in cards] == [(stack.model, "chainspec")]
    assert listed[0]["root"] == stack.model and listed[0]["parent"] is None
    assert listed[0]["max_model_len"] == CONTEXT
    one = get(url, f"/v1/models/{stack.model}")
    assert one.status_code == 200 and one.json() == listed[0]
    assert client.models.retrieve(stack.model).id == stack.model  # the official client
    assert [m.id for m in client.models.list()] == [stack.model]
    for unknown in ("nope", "org/name"):
        body = error(get(url, f"/v1/models/{unknown}"), 404, "model")
        assert body["code"] == "model_not_found" and repr(unknown) in body["message"]
        assert repr(stack.model) in body["message"]  # and what is served instead
    error(httpx.get(f"{url}/v1/models/{stack.model}"), 401)


def test_tokenize_a_prompt_and_detokenize(url, tok) -> None:
    r = post(url, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body, ids = r.json(), tok.encode(PROMPT)
    assert body == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids,
                    "token_strs": [tok.backend.id_to_token(i) for i in ids]}
    assert post(url, "/tokenize", {"prompt": ""}).json()["tokens"] == []
    back = post(url, "/detokenize", {"tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    error(post(url, "/detokenize", {"tokens": [1, tok.vocab_size]}), 400, "tokens[1]")
    error(post(url, "/tokenize", {"prompt": "x", "model": "nope"}), 400, "model")
    error(post(url, "/tokenize", {"prompt": "x", "add_bos": True}), 400, "add_bos")
    error(httpx.post(f"{url}/tokenize", json={"prompt": "x"}), 401)


def test_tokenize_a_chat_counts_what_chat_completions_bills(url, client, tok) -> None:
    r = post(url, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    rendered = chat_prompt([("user", PROMPT)])
    assert r.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    chat = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=2)
    assert r.json()["count"] == chat.usage.prompt_tokens
    without = post(url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert without.json()["count"] < r.json()["count"]  # the assistant's header left out


def test_version(url) -> None:
    r = httpx.get(f"{url}/version", timeout=10)  # open, as vLLM's is
    assert r.status_code == 200 and r.json() == {"version": chainspec_version()}


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(url) -> None:
    r = post(url, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    chat = ChatCompletion.model_validate(r.json())
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == CONTEXT - chat.usage.prompt_tokens > 256
    # completions keep OpenAI's 16
    cmpl = Completion.model_validate(post(url, "/v1/completions", {
        "prompt": PROMPT, "temperature": 0, "ignore_eos": True}).json())
    assert cmpl.usage.completion_tokens == 16


def test_logprob_bytes_are_the_tokens_own_bytes(url, tok) -> None:
    """A token holding one byte of a character (forced by logit_bias) shows its text as
    U+FFFD but its `bytes` as that byte, not U+FFFD's UTF-8 (EF BF BD)."""
    byte_token = tok.token_id("\u00e4")  # byte-level's piece for the byte 0xE4
    assert byte_token is not None and TokenBytes(tok)(byte_token) == b"\xe4"
    r = post(url, "/v1/chat/completions", {
        "messages": MESSAGES, "temperature": 0, "ignore_eos": True, "max_tokens": 3,
        "logprobs": True, "top_logprobs": 2, "logit_bias": {str(byte_token): 100}})
    assert r.status_code == 200, r.text
    content = ChatCompletion.model_validate(r.json()).choices[0].logprobs.content
    assert [(e.token, e.bytes) for e in content] == [("\ufffd", [0xE4])] * 3
    assert all(e.top_logprobs[0].bytes == [0xE4] for e in content)


def test_logprob_bytes_concatenate_to_the_output(url) -> None:
    r = post(url, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0,
                                           "ignore_eos": True, "max_tokens": 24,
                                           "logprobs": True})
    chat = ChatCompletion.model_validate(r.json())
    joined = b"".join(bytes(e.bytes) for e in chat.choices[0].logprobs.content)
    assert joined.decode("utf-8", "replace") == chat.choices[0].message.content

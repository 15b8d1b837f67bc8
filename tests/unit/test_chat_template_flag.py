"""Through the gateway's HTTP app: a model without a chat template answers chat requests
(and chat /tokenize) with a 400 naming the missing template and `--chat-template`, while
completions still serve; with `--chat-template` (a file or the text) the chat renders and
its prompt is what the verifier receives."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from chainspec.gateway.app import Gateway
from chainspec.gateway.asgi import build_app
from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.routing import VerifierPool
from tests.integration.tiny_checkpoint import write_tokenizer
from tests.unit.test_gateway_properties import FakeStub, FakeVerifier

CHAT = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        "max_tokens": 1}
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


class RecordingStub(FakeStub):
    def __init__(self) -> None:
        self.prompts: list[str] = []

    def Generate(self, request, timeout: float):  # noqa: N802
        self.prompts.append(request.text)
        return super().Generate(request, timeout)


def serve(chat: ChatTemplate, *posts: tuple[str, dict]) -> tuple[list[httpx.Response], list]:
    """Each (path, body) posted in turn; the answers and the prompts the verifier got."""
    verifier = FakeVerifier()
    verifier.stub = RecordingStub()
    pool = VerifierPool()
    pool.handles["fake:1"] = verifier
    app = build_app(Gateway(GatewayConfig(), pool, chat))

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            return [await client.post(path, json=body) for path, body in posts]
    try:
        return asyncio.run(run()), verifier.stub.prompts
    finally:
        chat.close()


def test_no_template_is_a_400_naming_the_flag(tmp_path) -> None:
    write_tokenizer(tmp_path, 300)  # a tokenizer, no chat template
    (chat, tokenize, completion), prompts = serve(
        ChatTemplate.from_model_dir(tmp_path), ("/v1/chat/completions", CHAT),
        ("/tokenize", {"messages": CHAT["messages"]}),
        ("/v1/completions", {"prompt": "U", "max_tokens": 1}))
    for r in (chat, tokenize):
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "messages", r.text
        assert "no chat template" in error["message"] and "--chat-template" in error["message"]
    assert completion.status_code == 200 and prompts == ["U"]  # nothing was invented


@pytest.mark.parametrize("as_file", [False, True])
def test_chat_template_flag_renders(tmp_path, as_file) -> None:
    value = TEMPLATE
    if as_file:
        value = str(tmp_path / "chat.jinja")
        (tmp_path / "chat.jinja").write_text(TEMPLATE)
    (r,), prompts = serve(ChatTemplate.from_model_dir(None, value),
                          ("/v1/chat/completions", CHAT))
    assert r.status_code == 200, r.text
    assert prompts == ["<system>S<user>U<assistant>"]

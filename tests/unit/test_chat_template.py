"""Chat templates are programs: a request's own template is refused unless trusted, and
every Jinja render (the server's too) runs in a killable worker process within a time,
size and memory limit; every failure is a 400 naming whose template failed. Plus the
worker pool itself: a runaway job's worker is killed and replaced, a dead worker is a
clean failure, `close` ends a call in flight."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from chainspec.gateway.chat_template import ChatTemplate, RenderLimits, Turn
from chainspec.gateway.errors import APIError
from chainspec.gateway.render_pool import RenderFailed, RenderPool, RenderTimeout

TIMEOUT_S = 0.5
TURNS = [Turn("user", "hi")]
ECHO = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
NESTED_LOOPS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                "{% endfor %}")


@pytest.fixture(scope="module")
def chat():
    """A server template and small limits (1,000 characters, 0.5 s)."""
    t = ChatTemplate(ECHO, limits=RenderLimits(timeout_s=TIMEOUT_S, max_chars=1000,
                                               memory_bytes=256 * 2 ** 20))
    yield t
    t.close()


def render(chat: ChatTemplate, template: str | None = None, turns=TURNS, **kw) -> str:
    return asyncio.run(chat.render(turns, template=template, trust_template=True, **kw))


def refusal(chat: ChatTemplate, template: str | None = None, turns=TURNS,
            **kw) -> tuple[APIError, float]:
    start = time.perf_counter()
    with pytest.raises(APIError) as e:
        render(chat, template, turns, **kw)
    assert e.value.status == 400
    return e.value, time.perf_counter() - start


def test_request_templates_need_trust(chat) -> None:
    with pytest.raises(APIError) as e:
        asyncio.run(chat.render(TURNS, template="{{ 'x' }}"))
    assert e.value.param == "chat_template" and "--trust-request-chat-template" in e.value.message
    e, _ = refusal(chat, variables={"chat_template": "{{ 'x' }}"})
    assert e.param == "chat_template_kwargs"
    assert render(chat, "{{ messages[0]['content'] }}!") == "hi!"
    assert render(chat) == "[user]hi"  # the server's own needs no trust


@pytest.mark.parametrize("template,says", [
    ("{{ 'x' * 100000000 }}", "'*' would build 100,000,000 items"),
    ("{{ [0] * 100000000 }}", "'*' would build 100,000,000 items"),
    ("{{ 'x' * 600 + 'y' * 600 }}", "'+' would build 1,200 items"),
    ("{{ 9 ** 99999999 }}", "'**' would build an integer over 64 Kibit"),
    ("{{ range(100000000) | list }}", "Range too big"),
    ("{% for i in range(1001) %}x{% endfor %}", "passed the limit of 1,000 characters"),
    ("{{ 'x'.ljust(2000000000) }}", "needed more than 256 MiB of memory"),
    ("{{ raise_exception('no tools') }}", "no tools"),
    ("{% for %}", "is not a valid Jinja template"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
])
def test_hostile_request_templates_are_400s_at_once(chat, template, says) -> None:
    e, took = refusal(chat, template)
    assert e.param == "chat_template" and says in e.message, e.message
    assert e.message.startswith("chat_template: the request's chat template")
    assert took < TIMEOUT_S  # refused by a limit, not by the clock


def test_limits_leave_what_fits(chat) -> None:
    assert render(chat, "{% for i in range(1000) %}x{% endfor %}") == "x" * 1000
    assert render(chat, "{{ 'x' * 500 + 'y' * 500 }}") == "x" * 500 + "y" * 500
    assert render(chat, "{{ 2 ** 100 }}") == str(2 ** 100)


def test_a_runaway_template_is_stopped_and_its_worker_replaced(chat) -> None:
    render(chat)  # the pool is up
    pids = {w._proc.pid for w in chat._pool._workers if w._proc is not None}
    e, took = refusal(chat, NESTED_LOOPS)
    assert e.param == "chat_template" and f"did not finish within {TIMEOUT_S:g} s" in e.message
    assert TIMEOUT_S <= took < TIMEOUT_S + 1.0
    alive = {w._proc.pid for w in chat._pool._workers if w._proc is not None}
    killed = pids - alive
    assert len(killed) == 1  # the other worker lives on
    with pytest.raises(ProcessLookupError):
        os.kill(killed.pop(), 0)  # gone (killed and reaped), not burning CPU
    assert [render(chat, "{{ 'ok' }}") for _ in range(3)] == ["ok"] * 3


def test_server_template_failures_name_the_server(chat) -> None:
    e, _ = refusal(chat, turns=[Turn("user", "x" * 1001)])
    assert e.param == "messages" and e.message.startswith(
        "messages: the server's chat template failed: its text passed the limit")


def test_no_template_is_a_400_naming_the_flag_and_starts_no_worker() -> None:
    t = ChatTemplate()
    with pytest.raises(APIError) as e:
        asyncio.run(t.render([Turn("user", "U")]))
    assert e.value.status == 400 and e.value.param == "messages"
    assert "has no chat template" in e.value.message and "--chat-template" in e.value.message
    assert t._pool is None  # nothing was invented, nothing rendered
    assert render(t, "{{ messages[0]['content'] }}?") == "hi?"  # a trusted request's own


def test_chat_template_flag_replaces_the_models(tmp_path) -> None:
    from tests.integration.tiny_checkpoint import write_tokenizer
    d = tmp_path / "m"
    write_tokenizer(d, 300)
    (d / "chat_template.jinja").write_text("model:{{ messages[0]['content'] }}")
    (tmp_path / "t.jinja").write_text("file:{{ messages[0]['content'] }}")
    inline = "inline:{{ messages[0]['content'] }}"
    for value, want in ((None, "model:hi"), (str(tmp_path / "t.jinja"), "file:hi"),
                        (inline, "inline:hi")):
        t = ChatTemplate.from_model_dir(d, value)
        try:
            assert asyncio.run(t.render(TURNS)) == want
            assert t.tokenizer is not None  # the model's tokenizer either way
        finally:
            t.close()


@pytest.mark.parametrize("value,says", [
    ("missing.jinja", "--chat-template missing.jinja: neither a template nor a readable file"),
    ("{% for %}", "--chat-template {% for %} is not a valid Jinja template: line 1:"),
])
def test_a_bad_chat_template_flag_is_one_line(value, says) -> None:
    with pytest.raises(ValueError) as e:
        ChatTemplate.from_model_dir(None, value)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_pool_timeout_death_and_close() -> None:
    pool = RenderPool(time.sleep, workers=1, timeout_s=0.3, memory_bytes=2 ** 28)
    try:
        assert asyncio.run(pool.call(0)) is None
        with pytest.raises(RenderTimeout):
            asyncio.run(pool.call(30))
        assert asyncio.run(pool.call(0)) is None  # a new worker
    finally:
        pool.close()
    dying = RenderPool(os._exit, workers=1, timeout_s=5, memory_bytes=2 ** 28)
    with pytest.raises(RenderFailed) as e:
        asyncio.run(dying.call(3))
    assert e.value.kind == "WorkerDied"
    dying.close()

    slow = RenderPool(time.sleep, workers=1, timeout_s=30, memory_bytes=2 ** 28)

    async def close_while_busy() -> float:
        call = asyncio.ensure_future(slow.call(30))
        await asyncio.sleep(1.0)  # the worker started and sleeps
        start = time.perf_counter()
        slow.close()
        with pytest.raises(RenderFailed):
            await call
        return time.perf_counter() - start
    assert asyncio.run(close_while_busy()) < 2.0

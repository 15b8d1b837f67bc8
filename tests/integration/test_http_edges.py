"""Input edges over a real socket (the red-team rows of the "Input edges" issue): deep
nesting, huge integers, values beyond the wire's uint32/uint64 fields, lone surrogates,
non-boolean booleans, non-JSON content types and oversize bodies are each a 400, 413 or
415 naming the field, never a 5xx or a 429; all on ONE keep-alive connection, which
still serves a valid request afterwards (a 500 would have closed it)."""

from __future__ import annotations

import http.client
import json
import time

import httpx
import pytest

from tests.integration.test_gateway import AUTH, error, stack, start_gateway  # noqa: F401

pytestmark = pytest.mark.timeout(300)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MIB = 2 ** 20


def body(value) -> bytes:
    return json.dumps(value).encode()  # lone surrogates are written as \ud800 escapes


def chat(content, **fields) -> bytes:
    return body({"messages": [{"role": "user", "content": content}], **fields})


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


# (name, path, body or chunked body, content type, status, param the error names)
ROWS = [
    ("nested 100k deep", COMPLETIONS, nested(100_000), None, 400, None),
    ("nested 100 deep", COMPLETIONS, nested(100), None, 400, "prompt"),
    ("5,000-digit max_tokens", COMPLETIONS, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000
     + b"}", None, 400, "max_tokens"),
    ("max_tokens 2^32", COMPLETIONS, body({"prompt": "hi", "max_tokens": 2 ** 32}), None, 400,
     "max_tokens"),
    ("top_k 2^32", COMPLETIONS, body({"prompt": "hi", "top_k": 2 ** 32}), None, 400, "top_k"),
    ("seed 2^64", COMPLETIONS, body({"prompt": "hi", "seed": 2 ** 64}), None, 400, "seed"),
    ("max_completion_tokens 2^32", CHAT, chat("hi", max_completion_tokens=2 ** 32), None, 400,
     "max_completion_tokens"),
    ("surrogate prompt", COMPLETIONS, body({"prompt": "a\ud800"}), None, 400, "prompt"),
    ("surrogate stop string", COMPLETIONS, body({"prompt": "hi", "stop": ["ok", "\udfff"]}),
     None, 400, "stop[1]"),
    ("surrogate chat content", CHAT, chat("\ud800"), None, 400, "messages[0].content"),
    ("surrogate content part", CHAT, chat([{"type": "text", "text": "\ud800"}]), None, 400,
     "messages[0].content[0].text"),
    ("surrogate field name", COMPLETIONS, body({"prompt": "hi", "\ud800": 1}), None, 400,
     "\\ud800"),
    ('stream "yes"', COMPLETIONS, body({"prompt": "hi", "stream": "yes"}), None, 400,
     "stream"),
    ("stream 1", CHAT, chat("hi", stream=1), None, 400, "stream"),
    ('ignore_eos "true"', COMPLETIONS, body({"prompt": "hi", "ignore_eos": "true"}), None,
     400, "ignore_eos"),
    ("NaN temperature", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', None, 400, None),
    ("not UTF-8", COMPLETIONS, b'{"prompt": "\xff"}', None, 400, None),
    ("text/plain", COMPLETIONS, body({"prompt": "hi"}), "text/plain", 415, None),
    ("a form", CHAT, b"messages=hi", "application/x-www-form-urlencoded", 415, None),
    ("prompt too long for the context", COMPLETIONS, body({"prompt": "x" * MIB}), None, 400,
     "prompt"),
    ("70 MB prompt", COMPLETIONS, body({"prompt": "x" * 70_000_000}), None, 413, None),
    ("chunked, over the limit", COMPLETIONS, [b'{"prompt": "', *[b"x" * MIB] * 9, b'"}'],
     None, 413, None),
]


def send(conn: http.client.HTTPConnection, path: str, content, content_type: str | None):
    """(response as httpx.Response, for the shared `error` check; the socket used)."""
    headers = {**AUTH, "Content-Type": content_type or "application/json"}
    conn.request("POST", path, body=content if isinstance(content, bytes) else iter(content),
                 headers=headers, encode_chunked=not isinstance(content, bytes))
    sock = conn.sock
    r = conn.getresponse()
    data = r.read()
    return httpx.Response(r.status, headers=r.getheaders(), content=data), sock


def check_row(conn, row) -> None:
    name, path, content, content_type, status, param = row
    started = time.monotonic()
    first = conn.sock
    r, sock = send(conn, path, content, content_type)
    assert sock is first and conn.sock is first, "the connection was closed"
    e = error(r, status, param)
    assert "Retry-After" not in r.headers, r.headers
    assert e["type"] == "invalid_request_error"
    assert time.monotonic() - started < 20


def test_input_edges_on_one_keep_alive_connection(stack) -> None:  # noqa: F811
    host, port = stack.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.connect()
    first, failures = conn.sock, []
    for row in ROWS:
        try:
            check_row(conn, row)
        except (AssertionError, OSError, http.client.HTTPException) as exc:
            failures.append(f"{row[0]}: {exc!r}"[:300])  # report every row
            conn.close()
            conn.connect()
    assert not failures, "\n".join(failures)
    r, sock = send(conn, COMPLETIONS, body({"prompt": "hello world", "max_tokens": 4,
                                            "temperature": 0}), None)
    assert sock is first and r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    conn.close()


def test_largest_wire_values_are_served(stack) -> None:  # noqa: F811
    """The bounds are the wire's, not tighter: uint32/uint64 maxima reach the verifier,
    which clamps max_tokens to the context and serves the request."""
    r = httpx.post(f"{stack.url}{COMPLETIONS}", headers=AUTH, timeout=120, json={
        "prompt": "hello world", "max_tokens": 2 ** 32 - 1, "top_k": 2 ** 32 - 1,
        "seed": 2 ** 64 - 1, "stop": ["x" * 100_000]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_body_limit_is_configurable(stack) -> None:  # noqa: F811
    """A small limit refuses a body just over it, by Content-Length and chunked alike,
    and takes one just under it."""
    small = start_gateway(stack.loop, [stack.verifier.address], max_body_bytes=4096)
    try:
        assert stack.loop.run(small.wait_ready(30))
        url = f"{small.url}{COMPLETIONS}"
        under = body({"prompt": "hi", "max_tokens": 2, "user": "u" * 3900})
        over = body({"prompt": "hi", "max_tokens": 2, "user": "u" * 4100})
        assert httpx.post(url, content=under).status_code == 200
        assert "4096 bytes" in error(httpx.post(url, content=over), 413)["message"]
        chunks = (over[i:i + 1000] for i in range(0, len(over), 1000))
        assert error(httpx.post(url, content=chunks), 413)["code"] == "request_too_large"
    finally:
        stack.loop.run(small.stop())


def test_prompt_over_the_grpc_message_limit_is_413_not_429(stack) -> None:  # noqa: F811
    """With a body limit above gRPC's message limit (64 MiB), a 70 MB prompt passes the
    gateway's own check; gRPC then refuses to send it (RESOURCE_EXHAUSTED), which is no
    full server: 413, not 429 with a Retry-After that can never succeed."""
    loose = start_gateway(stack.loop, [stack.verifier.address], max_body_bytes=100 * MIB)
    try:
        assert stack.loop.run(loose.wait_ready(30))
        r = httpx.post(f"{loose.url}{COMPLETIONS}", content=body({"prompt": "x" * 70_000_000}),
                       timeout=60)
        assert error(r, 413)["code"] == "request_too_large"
        assert "Retry-After" not in r.headers
    finally:
        stack.loop.run(loose.stop())

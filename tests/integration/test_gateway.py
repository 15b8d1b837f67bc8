"""The HTTP gateway over real gRPC services on 127.0.0.1 (no Ray): one drafter and one
verifier in this process, gateways with a static verifier list, driven by the official
`openai` client and httpx. Greedy output through HTTP equals plain decoding; errors are
OpenAI-shaped with the right status and never disturb a concurrent valid request; a
dropped client frees its verifier slot and drafter state; 32 concurrent streams."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.membership import StaticVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.models.loader import load_draft_model
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier
from tests.integration.grpc_helpers import free_port, wait_until
from tests.integration.helpers import plain_outputs, prompt_ids, verifier_stub
from tests.integration.tiny_checkpoint import CHAT_TEMPLATE, chat_prompt

pytestmark = pytest.mark.timeout(300)
K, MAX_LEN, TOKENS, LONG = 3, 512, 24, 480
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Stack:
    url: str
    verifier: object
    drafter_engine: DrafterEngine
    loop: object
    model: str


def start_gateway(loop, endpoints, **config) -> GatewayServer:
    config = GatewayConfig(port=0, refresh_interval_s=0.2, **config)
    return loop.run(GatewayServer.start(config, StaticVerifiers(endpoints),
                                        ChatTemplate(CHAT_TEMPLATE)))  # the tiny model's


@pytest.fixture(scope="module")
def stack(model_dir, loop_thread):
    engine = DrafterEngine(load_draft_model(model_dir, cache_len=MAX_LEN),
                           DrafterConfig(num_steps=K, max_seqs=64, max_len=MAX_LEN))
    drafter = loop_thread.run(serve_drafter(engine, ServerOptions(), "tiny"))
    opts = LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=8, max_len=MAX_LEN)
    verifier = loop_thread.run(serve_verifier(VerifierOptions(opts), ServerOptions(),
                                              [drafter.address]))
    # NOTE: trusting request templates, as the surface table's chat_template rows need
    gateway = start_gateway(loop_thread, [verifier.address], api_key=KEY,
                            trust_request_chat_template=True)
    assert loop_thread.run(gateway.wait_ready(30, drafters=1))
    yield Stack(gateway.url, verifier, engine, loop_thread, model_dir.name)
    loop_thread.run(gateway.stop())
    loop_thread.run(verifier.stop())
    loop_thread.run(drafter.stop())


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def plain(model_dir, tok):
    """Greedy texts of plain decoding (in-process engine, no drafter) per prompt."""
    return [tok.decode(t) for t in plain_outputs(model_dir, prompt_ids(model_dir), TOKENS)]


@pytest.fixture(scope="module")
def long_plain(model_dir, tok):
    """Plain greedy text of a LONG-token request for the first prompt (it runs for a few
    seconds through the stack, long enough to overlap other requests)."""
    opts = LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=1, max_len=MAX_LEN)
    engine = build_verifier(load_models(opts, speculative=False), opts, speculative=False)
    result = run_to_completion(engine, prompt_ids(model_dir)[:1],
                               SamplingParams(temperature=0.0),
                               StopConditions(max_tokens=LONG, ignore_eos=True))
    return tok.decode(result.completions[0].tokens)


def complete(client, prompt, max_tokens=TOKENS, **kw):
    return client.completions.create(model=None or openai.NOT_GIVEN, prompt=prompt,
                                     max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


class Streamer(threading.Thread):
    """A streamed completion in a thread (httpx), text and events collected."""

    def __init__(self, url: str, prompt, max_tokens: int = LONG, headers=AUTH) -> None:
        super().__init__(daemon=True)
        self.url, self.headers = url, headers
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True}
        self.text, self.events, self.status, self.done = "", [], None, False
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body,
                          headers=self.headers, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                self.started.set()
                if line == "data: [DONE]":
                    self.done = True
                    continue
                event = json.loads(line[6:])
                self.events.append(event)
                self.text += "".join(c["text"] for c in event.get("choices", []))
        self.started.set()

    def result(self) -> str:
        self.join(timeout=120)
        assert self.status == 200 and self.done, (self.status, self.events[-1:])
        return self.text


# ------------------------------------------------------------------------ the happy path


def test_completions_greedy_equal_plain_decoding(client, model_dir, plain) -> None:
    ids = prompt_ids(model_dir)
    outs = [complete(client, p) for p in ids]
    assert [o.choices[0].text for o in outs] == plain
    for o, p in zip(outs, ids, strict=True):
        assert o.object == "text_completion" and o.choices[0].finish_reason == "length"
        assert (o.usage.prompt_tokens, o.usage.completion_tokens) == (len(p), TOKENS)
        assert o.usage.total_tokens == len(p) + TOKENS
    spec = [o.usage.model_extra["speculative"] for o in outs]
    assert sum(s["accepted_tokens"] for s in spec) > 0  # drafts were used over gRPC
    assert all(len(s["accepted_per_position"]) == K for s in spec)
    assert max(s["acceptance_length"] for s in spec) > 1.5
    # a text prompt is tokenized by the verifier the same way
    assert complete(client, "hello world").choices[0].text == plain[1]


def test_a_repeated_prefix_is_read_from_both_caches(client, stack, model_dir) -> None:
    """Prefix caching through HTTP (DESIGN 4.12): the second request with the same long
    prefix reports usage.prompt_tokens_details.cached_tokens, the remote drafter reads
    its MTP KV from its cache, and the text is what the first request got."""
    prefix = [(5 * i) % 200 + 3 for i in range(70)]  # 4 full blocks, then a tail
    first = complete(client, prefix + [7])
    hits = stack.drafter_engine.allocator.cache.hits
    again = complete(client, prefix + [7])
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    # 4 blocks of 16 below the last row, all: the drafter was sent each one's key with
    # the K prompt tokens after it (engine/preemption.py admit_blocks)
    assert cached == 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert stack.drafter_engine.allocator.cache.hits == hits + 64


def test_streaming_equals_whole(client, model_dir, plain) -> None:
    chunks = list(complete(client, prompt_ids(model_dir)[0], stream=True,
                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_and_not(client, model_dir, tok) -> None:
    messages = [{"role": "system", "content": "You write code."},
                {"role": "user", "content": "def fibonacci(n):"}]
    prompt = tok.encode(chat_prompt([(m["role"], m["content"]) for m in messages]))
    want = tok.decode(plain_outputs(model_dir, [prompt], TOKENS)[0])
    kw = {"model": openai.NOT_GIVEN, "messages": messages, "max_tokens": TOKENS,
          "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want
    assert whole.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.model_extra["speculative"]["draft_tokens"] > 0


def test_stop_strings_and_max_tokens(client, plain) -> None:
    full = plain[1]
    assert "Zbo" in full  # the tiny model's greedy output for "hello world"
    out = complete(client, "hello world", stop=["Zbo"])
    assert out.choices[0].text == full[:full.index("Zbo")]
    assert out.choices[0].finish_reason == "stop"
    streamed = complete(client, "hello world", stop="Zbo", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index("Zbo")]
    short = complete(client, "hello world", max_tokens=5)
    assert short.usage.completion_tokens == 5 and short.choices[0].finish_reason == "length"
    default = client.completions.create(prompt="hello world", model=openai.NOT_GIVEN,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default for completions


def test_seeded_sampling_repeats(client) -> None:
    runs = [client.completions.create(model=openai.NOT_GIVEN, prompt="hello", max_tokens=16,
                                      temperature=0.9, top_p=0.95, seed=7,
                                      extra_body={"top_k": 20, "ignore_eos": True})
            for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text


def test_models_health_metrics(stack, client) -> None:
    assert [m.id for m in client.models.list().data] == [stack.model]
    health = httpx.get(f"{stack.url}/health").json()  # no key needed for probes
    assert health["status"] == "ok" and health["verifiers"] == 1
    assert health["drafters"] == 1 and health["speculative"] is True
    text = httpx.get(f"{stack.url}/metrics").text
    from prometheus_client.parser import text_string_to_metric_families
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"chainspec_gateway_requests", "chainspec_gateway_in_flight_requests"} <= names
    assert 'code="200",route="/v1/completions"' in text


# ------------------------------------------------------------------------------ errors


def error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["param"] == param and body["message"].startswith(f"{param}: "), body
    return body


def test_api_key(stack) -> None:
    url = f"{stack.url}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 2}
    error(httpx.post(url, json=body), 401)
    assert error(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}),
                 401)["type"] == "authentication_error"
    error(httpx.get(f"{stack.url}/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="nope", max_retries=0) \
            .completions.create(model=stack.model, prompt="hi", max_tokens=2)
    assert httpx.post(url, json=body, headers=AUTH).status_code == 200


BAD = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 7}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": [1] * 600}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "hi", "n": 99}, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 1000}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": -1}, "max_tokens"),
]


def test_bad_requests_are_400_and_spare_a_concurrent_stream(stack, model_dir, long_plain):
    # NOTE: template workers start on the first chat request (~0.3 s): not this test's
    # business, and long enough for a warm stream to end before the errors are sent
    assert httpx.post(f"{stack.url}/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}).status_code == 200
    valid = Streamer(stack.url, prompt_ids(model_dir)[0])
    assert valid.started.wait(60)
    # NOTE: sent at once, so all are answered while a warm stream still runs
    with concurrent.futures.ThreadPoolExecutor(len(BAD)) as pool:
        answers = list(pool.map(lambda case: httpx.post(
            f"{stack.url}{case[0]}", json=case[1], headers=AUTH), BAD))
    for (_, _, param), answer in zip(BAD, answers, strict=True):
        assert error(answer, 400, param)["type"] == "invalid_request_error"
    ctx = error(httpx.post(f"{stack.url}/v1/completions", json={"prompt": [1] * 600},
                           headers=AUTH), 400, "prompt")
    assert ctx["code"] == "context_length_exceeded" and "do not fit the context" in \
        ctx["message"]
    assert error(httpx.post(f"{stack.url}/v1/completions", content=b"{not json",
                            headers=AUTH), 400)["param"] is None
    error(httpx.get(f"{stack.url}/v1/nothing", headers=AUTH), 404)
    assert not valid.done  # the errors all happened while it streamed
    assert valid.result() == long_plain


def test_gateway_bound_is_429_and_spares_running_streams(stack, model_dir, long_plain):
    bounded = start_gateway(stack.loop, [stack.verifier.address], max_in_flight=2,
                            retry_after_s=3)
    try:
        assert stack.loop.run(bounded.wait_ready(30))
        running = [Streamer(bounded.url, prompt_ids(model_dir)[0], headers={})
                   for _ in range(2)]
        assert all(s.started.wait(60) for s in running)
        r = httpx.post(f"{bounded.url}/v1/completions", json={"prompt": "hi", "stream": True})
        assert error(r, 429)["type"] == "rate_limit_error"
        assert r.headers["Retry-After"] == "3"
        assert [s.result() for s in running] == [long_plain] * 2
        assert httpx.post(f"{bounded.url}/v1/completions",
                          json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        stack.loop.run(bounded.stop())


def test_not_ready_is_503_then_full_verifier_is_429(stack, model_dir, long_plain) -> None:
    """A gateway whose verifier is not up yet answers 503; once it serves, its one slot
    taken, the verifier's RESOURCE_EXHAUSTED becomes 429; the running request is fine."""
    port = free_port()
    gateway = start_gateway(stack.loop, [f"127.0.0.1:{port}"])
    small = None
    try:
        health = httpx.get(f"{gateway.url}/health")
        assert health.status_code == 503 and health.json()["verifiers"] == 0
        r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "hi"})
        assert error(r, 503)["type"] == "service_unavailable" and "Retry-After" in r.headers
        assert httpx.get(f"{gateway.url}/v1/models").json()["data"] == []
        opts = LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=1, max_len=MAX_LEN)
        small = stack.loop.run(serve_verifier(VerifierOptions(opts, max_waiting=0),
                                              ServerOptions(port=port)))
        assert stack.loop.run(gateway.wait_ready(30))
        assert httpx.get(f"{gateway.url}/health").json()["speculative"] is False
        first = Streamer(gateway.url, prompt_ids(model_dir)[0], headers={})
        assert first.started.wait(60)
        r = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "hi"})
        assert error(r, 429)["code"] == "overloaded" and r.headers["Retry-After"] == "1"
        assert first.result() == long_plain  # plain decoding: no drafters behind this one
    finally:
        stack.loop.run(gateway.stop())
        if small is not None:
            stack.loop.run(small.stop())


# --------------------------------------------------------------------------- disconnect


@pytest.fixture
def aborts(stack):
    """Request ids the verifier engine aborted during the test."""
    engine = stack.verifier.engine.engine
    seen, original = [], engine.abort

    def spy(request_id):
        seen.append(request_id)
        return original(request_id)
    engine.abort = spy
    yield seen
    engine.abort = original


def verifier_load(stack) -> tuple[int, int]:
    channel, stub = verifier_stub(stack.verifier.address)
    try:
        info = stub.Info(pb.VerifierInfoRequest(), timeout=5)
        return info.running, info.waiting
    finally:
        channel.close()


def idle(stack) -> bool:
    health = httpx.get(f"{stack.url}/health").json()
    return verifier_load(stack) == (0, 0) and stack.drafter_engine.load == 0 \
        and health["in_flight"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_dropped_client_frees_its_slot(stack, model_dir, aborts, stream) -> None:
    body = {"prompt": prompt_ids(model_dir)[0], "max_tokens": MAX_LEN - 20,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    url = f"{stack.url}/v1/completions"
    if stream:
        with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as r:
            lines = r.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(6), strict=False)
                       if line.startswith("data: ")) >= 2
            assert verifier_load(stack) == (1, 0) and stack.drafter_engine.load == 1
    else:
        wait_until(lambda: idle(stack), 10)
        # NOTE: a warm stack writes the whole answer in ~0.3 s: leave long before that
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.05))
    assert wait_until(lambda: idle(stack), 10), (verifier_load(stack),
                                                  stack.drafter_engine.load)
    assert [a for a in aborts if a.startswith("cmpl-")], "the engine never aborted it"


# -------------------------------------------------------------------------- concurrency


def test_32_concurrent_streams(stack, client, model_dir, plain) -> None:
    ids = prompt_ids(model_dir)
    results, errors = [None] * 32, []

    def one(i: int) -> None:
        try:
            chunks = complete(client, ids[i % len(ids)], stream=True)
            results[i] = "".join(c.choices[0].text for c in chunks)
        except Exception as e:  # reported below
            errors.append(f"{i}: {e!r}")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert results == [plain[i % len(ids)] for i in range(32)]
    assert time.monotonic() - t0 < 240
    assert wait_until(lambda: idle(stack), 10)


# ------------------------------------------------------------------ the gateway command


def test_gateway_command_serves_and_stops_on_sigterm(stack, tmp_path, plain) -> None:
    """`chainspec gateway --verifier ...` as its own process (how the Helm chart runs it,
    there over a stack's membership): key from a file, answers, exits 0 on SIGTERM."""
    key = tmp_path / "key"
    key.write_text("sk-cmd\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "chainspec.cli", "gateway", "--verifier",
         stack.verifier.address, "--port", str(port), "--api-key-file", str(key)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"gateway serving http://127.0.0.1:{port}", line
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 30)
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-cmd"},
                       json={"prompt": "hello world", "max_tokens": TOKENS, "temperature": 0,
                             "ignore_eos": True}, timeout=60)
        assert r.json()["choices"][0]["text"] == plain[1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

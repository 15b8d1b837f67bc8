"""Mid-stream failover through the gateway over real gRPC (no Ray): verifiers that die
after k tokens. Two "dying" verifiers forward to one real verifier and end every new
stream with UNAVAILABLE after k tokens (continuations pass); the gateway over them must
give the client exactly what a gateway over the real verifier gives -- text, token ids
(logprobs), finish reason and usage -- greedy and seeded sampled, streamed and not, n = 2,
with a stop string held back across the cut. Bounded: a stream whose every verifier dies
ends with the error event after MAX_RESUMES resumes, and one with no other verifier
waits `wait_s`, then ends with the error."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import grpc
import httpx
import pytest

from chainspec.engine.local import LocalOptions
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.failover import MAX_RESUMES
from chainspec.gateway.membership import StaticVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.rpc.channel import make_aio_channel
from chainspec.rpc.generated.v1 import verifier_pb2_grpc as pb_grpc
from chainspec.rpc.server import ServerOptions, start_server
from chainspec.rpc.verifier_service import VERIFIER_SERVICE, VerifierOptions, serve_verifier

pytestmark = pytest.mark.timeout(300)
TOKENS, WAIT_S = 40, 1.5


class DyingVerifier(pb_grpc.VerifierServicer):
    """Forwards to a real verifier; a stream that is not a continuation (or any stream,
    with `always`) ends with UNAVAILABLE once `after` tokens went out."""

    def __init__(self, backend: str, after: int, always: bool = False,
                 extra_load: int = 0, continues: bool = True) -> None:
        self.backend, self.after, self.always = backend, after, always
        self.extra_load = extra_load  # added to the load its Info reports
        self.continues = continues  # what its Info says (False: an older verifier)
        self.stub, self.kills = None, 0
        self.on_kill = lambda: None

    async def Generate(self, request, context):
        if self.stub is None:
            self.stub = pb_grpc.VerifierStub(make_aio_channel(self.backend))
        call, sent = self.stub.Generate(request), 0
        dies = self.always or not request.HasField("continuation")
        async for msg in call:
            yield msg
            sent += len(msg.chunk.token_ids)
            if dies and sent >= self.after and not msg.HasField("finished"):
                call.cancel()
                self.kills += 1
                self.on_kill()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier died (test)")

    async def Info(self, request, context):
        if self.stub is None:
            self.stub = pb_grpc.VerifierStub(make_aio_channel(self.backend))
        info = await self.stub.Info(request)
        info.running += self.extra_load
        info.continues = self.continues
        return info


@dataclasses.dataclass
class Stack:
    loop: object
    real: object
    reference: GatewayServer  # over the real verifier
    servers: list

    def dying(self, *proxies: DyingVerifier) -> GatewayServer:
        """A gateway over `proxies` (each its own gRPC server), resumes waiting WAIT_S."""
        endpoints = []
        for proxy in proxies:
            running = self.loop.run(start_server(ServerOptions(), lambda s, p=proxy:
                                                 pb_grpc.add_VerifierServicer_to_server(p, s),
                                                 [VERIFIER_SERVICE]))
            self.loop.run(running.set_serving(True))
            self.servers.append(running)
            endpoints.append(running.address)
        gateway = _gateway(self.loop, endpoints)
        gateway.gateway.failover = dataclasses.replace(gateway.gateway.failover,
                                                       wait_s=WAIT_S)
        self.servers.append(gateway)
        return gateway


def _gateway(loop, endpoints) -> GatewayServer:
    config = GatewayConfig(port=0, refresh_interval_s=0.2)
    gateway = loop.run(GatewayServer.start(config, StaticVerifiers(endpoints)))
    assert loop.run(gateway.wait_ready(30))
    return gateway


@pytest.fixture(scope="module")
def stack(model_dir, loop_thread):
    opts = LocalOptions(model_dir=model_dir, num_steps=3, max_seqs=8, max_len=256)
    real = loop_thread.run(serve_verifier(VerifierOptions(opts, drafter="local"),
                                          ServerOptions()))
    s = Stack(loop_thread, real, _gateway(loop_thread, [real.address]), [])
    yield s
    for server in [*s.servers, s.reference]:
        loop_thread.run(server.stop())
    loop_thread.run(real.stop())


@dataclasses.dataclass
class Answer:
    texts: dict[int, str]
    tokens: dict[int, list[str]]  # logprobs' tokens per choice
    finish: dict[int, str]
    usage: dict | None
    error: dict | None


def ask(gateway: GatewayServer, body: dict, path: str = "/v1/completions") -> Answer:
    """The answer to `body`, streamed (SSE events parsed) or not."""
    body = {"max_tokens": TOKENS, **body}
    url = f"{gateway.url}{path}"
    ans = Answer({}, {}, {}, None, None)
    if not body.get("stream"):
        r = httpx.post(url, json=body, timeout=60)
        data = r.json()
        if r.status_code != 200:
            ans.error = data["error"]
            return ans
        for c in data["choices"]:
            ans.texts[c["index"]] = c.get("text", c.get("message", {}).get("content"))
            ans.finish[c["index"]] = c["finish_reason"]
            ans.tokens[c["index"]] = (c["logprobs"] or {}).get("tokens", [])
        ans.usage = data["usage"]
        return ans
    with httpx.stream("POST", url, json={**body, "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                ans.error = event["error"]
                continue
            ans.usage = event.get("usage") or ans.usage
            for c in event["choices"]:
                i = c["index"]
                ans.texts[i] = ans.texts.get(i, "") + (c.get("text") or
                                                       c.get("delta", {}).get("content") or "")
                ans.tokens.setdefault(i, []).extend((c["logprobs"] or {}).get("tokens", []))
                if c["finish_reason"]:
                    ans.finish[i] = c["finish_reason"]
    return ans


def _resumes(gateway: GatewayServer) -> float:
    return gateway.gateway.metrics.registry.get_sample_value(
        "chainspec_gateway_stream_resumes_total") or 0.0


GREEDY = {"prompt": "def fibonacci(n):", "temperature": 0, "ignore_eos": True,
          "logprobs": 1}
SAMPLED = {"prompt": "€ 你好 🙂", "temperature": 0.9, "seed": 11, "presence_penalty": 0.5,
           "ignore_eos": True, "logprobs": 1}


@pytest.mark.parametrize("body", [GREEDY, {**GREEDY, "stream": True},
                                  {**SAMPLED, "stream": True}, {**SAMPLED, "n": 2},
                                  {**SAMPLED, "n": 2, "stream": True}],
                         ids=["greedy", "greedy-stream", "seeded-stream", "seeded-n2",
                              "seeded-n2-stream"])
def test_a_resumed_stream_equals_an_uninterrupted_one(stack, body) -> None:
    want = ask(stack.reference, body)
    assert want.error is None and all(len(t) == TOKENS for t in want.tokens.values())
    for after in (1, 17):
        proxies = DyingVerifier(stack.real.address, after), \
            DyingVerifier(stack.real.address, after)
        gateway = stack.dying(*proxies)
        got = ask(gateway, body)
        assert got.error is None, got.error
        assert (got.texts, got.tokens, got.finish) == (want.texts, want.tokens, want.finish)
        assert got.usage["prompt_tokens"] == want.usage["prompt_tokens"]
        assert got.usage["completion_tokens"] == want.usage["completion_tokens"]
        choices = body.get("n", 1)
        assert sum(p.kills for p in proxies) == choices  # every choice died once
        assert _resumes(gateway) == choices


def test_a_stop_string_held_back_at_the_cut_still_stops(stack) -> None:
    """Stop at a string from the middle of the output: at cuts before and inside it (the
    verifier holding its prefix back) the client's text is the uninterrupted one."""
    body = {**GREEDY, "stream": True}
    whole = ask(stack.reference, body).texts[0]
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    want = ask(stack.reference, {**body, "stop": [stop]})
    assert want.finish == {0: "stop"} and len(want.texts[0]) < len(whole)
    cut = len(want.tokens[0])  # tokens streamed before the stop string
    for after in range(max(1, cut - 2), cut + 3):
        got = ask(stack.dying(DyingVerifier(stack.real.address, after),
                              DyingVerifier(stack.real.address, after)),
                  {**body, "stop": [stop]})
        assert (got.texts, got.finish, got.error) == (want.texts, want.finish, None), after


def test_resumes_are_bounded_then_the_error_event(stack) -> None:
    """Every verifier dies on every stream: MAX_RESUMES resumes, then the error event
    naming the cause."""
    proxies = [DyingVerifier(stack.real.address, 3, always=True) for _ in range(3)]
    gateway = stack.dying(*proxies)
    got = ask(gateway, {**GREEDY, "stream": True})
    assert got.error is not None and "died" in got.error["message"], got.error
    assert sum(p.kills for p in proxies) == MAX_RESUMES + 1
    assert _resumes(gateway) == MAX_RESUMES
    assert len(got.tokens[0]) >= 3 * (MAX_RESUMES + 1)  # each verifier added tokens


def test_with_no_other_verifier_the_stream_waits_then_ends_with_the_error(stack) -> None:
    gateway = stack.dying(DyingVerifier(stack.real.address, 3))
    t0 = time.monotonic()
    got = ask(gateway, {**GREEDY, "stream": True})
    took = time.monotonic() - t0
    assert got.error is not None and got.error["code"] == "unavailable", got.error
    assert "no other verifier" in got.error["message"] and "died" in got.error["message"]
    assert WAIT_S <= took < WAIT_S + 5, took
    assert _resumes(gateway) == 0


def test_a_verifier_that_failed_the_stream_is_not_tried_again_while_serving(stack) -> None:
    """A (least loaded, still SERVING) kills every stream, continuations too; B is busier
    but sound: the stream resumes on B, never again on A."""
    a = DyingVerifier(stack.real.address, 4, always=True)
    b = DyingVerifier(stack.real.address, 10 ** 6, extra_load=5)
    gateway = stack.dying(a, b)
    want = ask(stack.reference, {**GREEDY, "stream": True})
    got = ask(gateway, {**GREEDY, "stream": True})
    assert (got.texts, got.tokens, got.error) == (want.texts, want.tokens, None)
    assert (a.kills, _resumes(gateway)) == (1, 1)


def test_a_verifier_that_comes_back_takes_the_resume(stack) -> None:
    """The only verifier fails the stream, turns NOT_SERVING and SERVING again within
    the wait (a restarted group): the stream resumes there and completes."""
    proxy = DyingVerifier(stack.real.address, 4)
    gateway = stack.dying(proxy)
    server = stack.servers[-2]  # the proxy's gRPC server

    async def flap() -> None:
        await server.set_serving(False)
        await asyncio.sleep(0.6)  # the gateway's pool polls every 0.2 s
        await server.set_serving(True)
    proxy.on_kill = lambda: asyncio.ensure_future(flap())
    want = ask(stack.reference, {**GREEDY, "stream": True})
    got = ask(gateway, {**GREEDY, "stream": True})
    assert (got.texts, got.tokens, got.error) == (want.texts, want.tokens, None)
    assert (proxy.kills, _resumes(gateway)) == (1, 1)


def test_a_verifier_that_does_not_continue_is_not_resumed_on(stack) -> None:
    """B (an older verifier: its Info does not say `continues`) would ignore the
    continuation and start the output again: the stream ends with the error instead."""
    b = DyingVerifier(stack.real.address, 10 ** 6, extra_load=5, continues=False)
    gateway = stack.dying(DyingVerifier(stack.real.address, 4), b)
    got = ask(gateway, {**GREEDY, "stream": True})
    assert got.error is not None and "no other verifier" in got.error["message"], got.error
    assert _resumes(gateway) == 0

"""Extreme-value requests (issue 19): random bodies that put zero, denormal, float32-edge,
float64-edge and out-of-range values into every numeric parameter of both endpoints,
streamed and not, and the checks every answer must pass:
- never a 5xx;
- every body and every SSE event is strict JSON (no NaN/Infinity literals), every number
  in it finite, every logprob in [-9999, 0];
- a 400 names a parameter the body has (or none, for a body that is not JSON);
- a greedy answer (temperature below 1e-5, denormals included) equals plain decoding
  (an in-process engine without a drafter) with the same processing parameters, as the
  verifier reads them (float32);
- echo with max_tokens 0 is the prompt alone.
Shared by tests/integration/test_extreme_values.py and benchmarks/extreme_values.py; the
stack is a drafter, a verifier and a gateway (with the model's tokenizer) on loopback."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.gateway.chat_template import ChatTemplate, Turn
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.membership import StaticVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.models.loader import load_draft_model
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["def f(x):", "hello world", "for i in range(3):", "The quick brown fox"]
MAX_TOKENS, K, MAX_LEN = 4, 3, 256
GREEDY_BELOW = 1e-5  # vLLM's rule, as the gateway documents it
LOGPROB_FLOOR = -9999.0
TINY = 2.0 ** -126  # float32's smallest normal number

# Values every float field is tried with: zeros, float64 and float32 denormals, float32's
# smallest normal and its neighbour below, vLLM's greedy threshold and its neighbours,
# the documented bounds and just past them, float32's largest value and past it, float64's.
EXTREMES = [0.0, -0.0, 5e-324, -5e-324, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754942e-38, TINY,
            -TINY, 1e-30, 9.99e-6, 1e-5, 1e-3, 0.0099, 0.01, 0.5, 1.0, 1.0000001, 2.0,
            2.0000001, 100.0, 100.01, 1e6, 3.4028235e38, 3.5e38, 1e300,
            1.7976931348623157e308, -0.5, -1.0, -2.0, -2.0000001, -100.0, -1e300]
RAW = ["1e999", "-1e999", "1e-400", "-0", "1E+2", "NaN", "-Infinity"]  # JSON text as is
EDGES = {  # edge values inside each field's documented range
    "temperature": [0.0, 5e-324, 1e-45, 1e-40, TINY, 9.99e-6, 1e-5, 1e-3, 0.7, 2.0],
    "top_p": [TINY, 1e-30, 1e-5, 0.5, 1.0],
    "min_p": [0.0, TINY, 1e-30, 0.5, 1.0],
    "presence_penalty": [0.0, TINY, -TINY, 1e-30, 2.0, -2.0],
    "frequency_penalty": [0.0, TINY, -TINY, -1e-30, 2.0, -2.0],
    "repetition_penalty": [0.01, 0.5, 1.0, 2.0, 100.0],
    "top_k": [-1, 0, 1, 2, 2 ** 32 - 1],
    "seed": [0, 1, 2 ** 64 - 1],
    "min_tokens": [0, 1],
}
BIAS_EDGES = [0.0, TINY, -TINY, 1e-30, 100.0, -100.0, 50.0]
PROCESSING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
              "min_tokens", "top_k", "top_p")


@dataclass(frozen=True)
class Raw:
    """A JSON number written as is (what json.dumps cannot write: 1e999, NaN...)."""

    text: str

    def value(self) -> float | int | None:
        """What the gateway reads (None: not JSON, the body is refused)."""
        return None if self.text in ("NaN", "-Infinity") else json.loads(self.text)


def dump(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def number(rng: random.Random, edges: list) -> Any:
    r = rng.random()
    if r < 0.7:
        return rng.choice(edges)
    if r < 0.88:
        return rng.choice(EXTREMES)
    if r < 0.95:
        return Raw(rng.choice(RAW))
    return math.ldexp(rng.uniform(-1, 1), rng.randint(-1074, 1024))  # any finite float


def random_request(rng: random.Random, vocab: int) -> tuple[str, dict]:
    """(path, body) with extreme values in a random subset of the numeric fields."""
    path, prompt = rng.choice([CMPL, CHAT]), rng.choice(PROMPTS)
    body: dict[str, Any] = {"max_tokens": rng.randint(1, MAX_TOKENS),
                            "ignore_eos": rng.random() < 0.8, "stream": rng.random() < 0.5}
    body.update({"prompt": prompt} if path == CMPL else
                {"messages": [{"role": "user", "content": prompt}]})
    for name, edges in EDGES.items():
        if rng.random() < (0.9 if name == "temperature" else 0.3):
            body[name] = number(rng, edges)
    if rng.random() < 0.3:
        body["logit_bias"] = {str(rng.randrange(vocab)): number(rng, BIAS_EDGES)
                              for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.5:
        n = rng.choice([0, 1, 5, 20])
        body.update({"logprobs": n} if path == CMPL else {"logprobs": True, "top_logprobs": n})
    if rng.random() < 0.1:
        body["n"] = 2
    if rng.random() < 0.05:  # the integer fields' extremes: all refused
        body["max_tokens"] = rng.choice([-1, 2 ** 32, 1.5, Raw("1e999"), TINY, 2 ** 64])
    if path == CMPL and rng.random() < 0.1:  # vLLM: the prompt alone
        body.update(echo=True, max_tokens=0)
        body.pop("logprobs", None)
    return path, body


# --------------------------------------------------------------------------- checks


def strict_loads(text: str) -> Any:
    """JSON as a strict client reads it: NaN, Infinity and -Infinity are errors."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def numbers(value: Any, path: str = "") -> list[tuple[str, float]]:
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in numbers(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in numbers(v, f"{path}[{i}]")]
    if isinstance(value, float | int) and not isinstance(value, bool):
        return [(path, value)]
    return []


def check_numbers(body: Any) -> None:
    """Every number finite; every logprob (a number under `logprobs` other than a byte or
    a text offset) in [LOGPROB_FLOOR, 0]."""
    for path, x in numbers(body):
        assert math.isfinite(x), f"{path} = {x}"
        last = re.sub(r"(\[\d+\])+$", "", path.rsplit(".", 1)[-1])
        if ".logprobs." in path and last not in ("bytes", "text_offset"):
            assert LOGPROB_FLOOR <= x <= 0, f"{path} = {x}"


@dataclass
class Answer:
    status: int
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text
    finish: dict[int, str] = field(default_factory=dict)
    error: dict | None = None


def read_answer(response: httpx.Response, stream: bool) -> Answer:
    """The answer, checked for 5xx and strict finite JSON (AssertionError otherwise)."""
    assert response.status_code < 500, (response.status_code, response.text[:400])
    answer = Answer(response.status_code)
    if response.status_code != 200:
        body = strict_loads(response.text)
        answer.error = body["error"]
        return answer
    if not stream:
        body = strict_loads(response.text)
        check_numbers(body)
        for c in body["choices"]:
            answer.texts[c["index"]] = c["text"] if "text" in c else c["message"]["content"]
            answer.finish[c["index"]] = c["finish_reason"]
        return answer
    assert response.text.endswith("data: [DONE]\n\n"), response.text[-400:]
    for block in response.text.split("\n\n")[:-2]:
        assert block.startswith("data: "), block
        chunk = strict_loads(block[len("data: "):])
        assert "error" not in chunk, chunk
        check_numbers(chunk)
        for c in chunk["choices"]:
            piece = c["text"] if "text" in c else c["delta"].get("content", "")
            answer.texts[c["index"]] = answer.texts.get(c["index"], "") + (piece or "")
            if c["finish_reason"]:
                answer.finish[c["index"]] = c["finish_reason"]
    return answer


def check_error(body: dict, error: dict) -> None:
    """A 400 names a parameter of the body (None: the body was not JSON)."""
    param = error["param"]
    if param is None:
        return
    top = param.split(".", 1)[0].split("[", 1)[0]
    assert top in body, (param, body)
    assert error["message"].startswith(f"{param}: "), error


def float32(x: float) -> float:
    """x as the verifier reads it from the wire's float field."""
    return struct.unpack("f", struct.pack("f", x))[0]


def value_of(v: Any) -> Any:
    return v.value() if isinstance(v, Raw) else v


def greedy_params(body: dict) -> SamplingParams | None:
    """The engine's SamplingParams of a greedy request that was answered 200; None when
    the request samples."""
    t = value_of(body.get("temperature", 1.0))
    if t is None or t >= GREEDY_BELOW:
        return None
    kw = {k: value_of(body[k]) for k in PROCESSING if k in body}
    kw = {k: float32(v) if isinstance(v, float) else v for k, v in kw.items()}
    bias = {int(t): float32(float(value_of(v))) for t, v in body.get("logit_bias", {}).items()}
    return SamplingParams(temperature=0.0, logit_bias=bias, **kw)


class Plain:
    """Plain greedy decoding (no drafter) in process, one run per distinct request."""

    def __init__(self, model_dir: Path) -> None:
        opts = LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=4, max_len=MAX_LEN)
        self.engine = build_verifier(load_models(opts, speculative=False), opts,
                                     speculative=False)
        self.tok = Tokenizer.from_dir(model_dir)
        self.chat = ChatTemplate.from_model_dir(model_dir)
        self._cache: dict[tuple, str] = {}

    def text(self, path: str, body: dict, params: SamplingParams) -> str:
        content = body["prompt"] if path == CMPL else body["messages"][0]["content"]
        prompt = content if path == CMPL else asyncio.run(
            self.chat.render([Turn("user", content)]))
        stop = StopConditions(max_tokens=body["max_tokens"],
                              ignore_eos=body.get("ignore_eos", False))
        key = (prompt, params, stop)
        if key not in self._cache:
            result = run_to_completion(self.engine, [self.tok.encode(prompt)], params, stop)
            self._cache[key] = self.tok.decode(result.completions[0].tokens)
        return self._cache[key]


@dataclass
class Tally:
    """What a run saw (the benchmark records it; the test asserts on it)."""

    statuses: Counter = field(default_factory=Counter)
    streamed: int = 0
    greedy_compared: int = 0
    prompt_only: int = 0
    failures: list[str] = field(default_factory=list)


def run_one(client: httpx.Client, plain: Plain, path: str, body: dict, tally: Tally) -> None:
    """Send one request and check its answer; a failed check lands in tally.failures."""
    try:
        response = client.post(path, content=dump(body).encode(),
                               headers={"content-type": "application/json"})
        answer = read_answer(response, body["stream"])
        tally.statuses[answer.status] += 1
        tally.streamed += body["stream"]
        if answer.error is not None:
            check_error(body, answer.error)
            return
        assert answer.finish and set(answer.texts) == set(answer.finish), answer
        if body.get("echo") and body["max_tokens"] == 0:
            tally.prompt_only += 1
            assert all(t == body["prompt"] for t in answer.texts.values()), answer.texts
            assert set(answer.finish.values()) == {"length"}, answer.finish
            return
        params = greedy_params(body)
        if params is not None:
            tally.greedy_compared += 1
            want = plain.text(path, body, params)
            echo = body["prompt"] if body.get("echo") else ""
            assert all(t == echo + want for t in answer.texts.values()), (answer.texts, want)
    except AssertionError as e:
        tally.failures.append(f"{path} {dump(body)}: {e}")


@dataclass
class Stack:
    url: str
    stop: Callable[[], None]


def start_stack(loop, model_dir: Path) -> Stack:
    """Drafter + verifier (gRPC) + gateway with the model's tokenizer, on `loop` (a
    tests.integration.helpers.LoopThread)."""
    engine = DrafterEngine(load_draft_model(model_dir, cache_len=MAX_LEN),
                           DrafterConfig(num_steps=K, max_seqs=16, max_len=MAX_LEN))
    drafter = loop.run(serve_drafter(engine, ServerOptions(), "tiny"))
    opts = LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=8, max_len=MAX_LEN)
    verifier = loop.run(serve_verifier(VerifierOptions(opts), ServerOptions(),
                                       [drafter.address]))
    gateway = loop.run(GatewayServer.start(GatewayConfig(port=0, refresh_interval_s=0.2),
                                           StaticVerifiers([verifier.address]),
                                           ChatTemplate.from_model_dir(model_dir)))
    assert loop.run(gateway.wait_ready(60, drafters=1))

    def stop() -> None:
        loop.run(gateway.stop())
        loop.run(verifier.stop())
        loop.run(drafter.stop())
    return Stack(gateway.url, stop)

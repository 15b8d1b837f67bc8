"""No NaN and no 5xx from extreme values (issue 19), through the whole stack (HTTP ->
gateway -> verifier -> drafter, gRPC on loopback): hypothesis drives random bodies with
zero, denormal, float32/float64-edge and out-of-range values in every numeric parameter,
streamed and not (tests/integration/extreme_requests.py says what each answer must be:
no 5xx, strict finite JSON in every event, logprobs in [-9999, 0], a 400 naming a
parameter, greedy output equal to plain decoding). benchmarks/extreme_values.py runs
2,000 of the same. Plus the red-team repros, one by one."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chainspec.models.tokenizer import Tokenizer
from tests.integration.extreme_requests import (
    CMPL,
    Plain,
    Tally,
    greedy_params,
    random_request,
    read_answer,
    run_one,
    start_stack,
    strict_loads,
)

pytestmark = pytest.mark.timeout(300)
EXAMPLES = 2000


@pytest.fixture(scope="module")
def stack(model_dir, loop_thread):
    s = start_stack(loop_thread, model_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def plain(model_dir):
    return Plain(model_dir)


def test_random_extreme_values(client, plain, model_dir) -> None:
    vocab = Tokenizer.from_dir(model_dir).vocab_size
    tally = Tally()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(rng=st.randoms(use_true_random=False))
    def one(rng: random.Random) -> None:
        path, body = random_request(rng, vocab)
        before = len(tally.failures)
        run_one(client, plain, path, body, tally)
        assert len(tally.failures) == before, tally.failures[-1]
    one()
    # NOTE: a generator that only made bad bodies would pass vacuously
    seen = sum(tally.statuses.values())
    assert seen >= EXAMPLES and set(tally.statuses) == {200, 400}, tally.statuses
    # (the generator's extremes, max_tokens' included, leave ~24 % of bodies valid)
    assert tally.statuses[200] >= seen // 5 and tally.streamed >= seen // 4, tally
    assert tally.greedy_compared >= seen // 20 and tally.prompt_only >= 3, tally


REPRO = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0,
         "repetition_penalty": 1e-40, "logprobs": 1}


@pytest.mark.parametrize("stream", [False, True])
def test_red_team_repro_is_400_naming_the_bound(client, stream) -> None:
    answer = read_answer(client.post(CMPL, json={**REPRO, "stream": stream}), False)
    assert answer.status == 400 and answer.error["param"] == "repetition_penalty"
    assert "0.01" in answer.error["message"], answer.error


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 9.9e-6])
@pytest.mark.parametrize("stream", [False, True])
def test_tiny_temperature_is_greedy(client, plain, temperature, stream) -> None:
    """vLLM's rule: below 1e-5 is greedy (it used to end at once with EOS)."""
    body = {**REPRO, "repetition_penalty": 1.3, "temperature": temperature,
            "stream": stream, "ignore_eos": False}
    answer = read_answer(client.post(CMPL, json=body), stream)
    want = plain.text(CMPL, body, greedy_params(body))
    assert answer.status == 200 and answer.texts == {0: want} and len(want) > 0


def test_echo_with_max_tokens_0_is_the_prompt(client, model_dir) -> None:
    """vLLM's answer: the prompt alone, finish `length`, its tokens counted, none generated."""
    body = {"prompt": "hello world", "echo": True, "max_tokens": 0, "n": 2}
    whole = strict_loads(client.post(CMPL, json=body).text)
    assert [c["text"] for c in whole["choices"]] == ["hello world"] * 2
    assert {c["finish_reason"] for c in whole["choices"]} == {"length"}
    prompt_tokens = len(Tokenizer.from_dir(model_dir).encode("hello world"))
    assert whole["usage"]["prompt_tokens"] == prompt_tokens
    assert whole["usage"]["completion_tokens"] == 0
    streamed = read_answer(client.post(CMPL, json={**body, "stream": True}), True)
    assert streamed.texts == {0: "hello world", 1: "hello world"}
    assert streamed.finish == {0: "length", 1: "length"}


def test_latin1_body_reads_as_latin1(client) -> None:
    prompt = "caf\u00e9 \u00bd"
    raw = json.dumps({"prompt": prompt, "echo": True, "max_tokens": 1},
                     ensure_ascii=False).encode("latin-1")
    latin1 = {"content-type": "application/json; charset=latin-1"}
    r = client.post(CMPL, content=raw, headers=latin1)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(prompt)
    r = client.post(CMPL, content=raw, headers={"content-type":
                                                "application/json; charset=utf-7"})
    assert r.status_code == 415 and "'utf-7'" in r.json()["error"]["message"]
    r = client.post(CMPL, content=raw)  # no charset: UTF-8, which these bytes are not
    assert r.status_code == 400 and "not UTF-8" in r.json()["error"]["message"]

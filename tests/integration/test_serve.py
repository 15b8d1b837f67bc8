"""`chainspec serve` as a real process joined to the session's Ray (`--address`): it
prints progress and a working curl line, answers the official `openai` client with
plain decoding's greedy output, registers its gateway in the stack's membership, and
`chainspec status`, `scale` and `down` from other processes act on it. Tests run in file
order; the last one stops the stack from another process."""

from __future__ import annotations

import json
import shlex
import subprocess
import time

import httpx
import openai
import pytest

from chainspec.models.tokenizer import Tokenizer
from tests.integration import helpers
from tests.integration.grpc_helpers import wait_until
from tests.integration.helpers import plain_outputs, prompt_ids, start_serve

pytestmark = pytest.mark.timeout(300)
NS = "chainspec-serve-test"
TOKENS = 24


def cli(*args: str) -> subprocess.CompletedProcess:
    return helpers.cli(NS, *args)


@pytest.fixture(scope="module")
def served(ray_cluster, model_dir):
    s = start_serve(model_dir, NS)
    yield s
    helpers.stop_serve(s, NS, 60)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def plain(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    return [tok.decode(t) for t in plain_outputs(model_dir, prompt_ids(model_dir, 3), TOKENS)]


def greedy(client, prompts):
    return [client.completions.create(model=openai.NOT_GIVEN, prompt=p, max_tokens=TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
            for p in prompts]


def test_prints_progress_and_a_working_curl_line(served) -> None:
    out = served.output()
    for needle in ("joining the Ray cluster", "loading and warming up", "stack up:",
                   "ready: 1 verifier(s), 1 drafter(s) connected (speculative decoding on)",
                   f"at {served.url} (OpenAI-compatible: base_url {served.url}/v1)"):
        assert needle in out, out
    curl = next(line for line in served.lines if "curl" in line and "/v1/completions" in line)
    argv = shlex.split(curl.split("try:", 1)[1])
    body = json.loads(argv[argv.index("-d") + 1])
    r = httpx.post(argv[1], json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32


def test_openai_client_against_the_stack(served, client, model_dir, plain) -> None:
    outs = greedy(client, prompt_ids(model_dir, 3))
    assert [o.choices[0].text for o in outs] == plain
    assert sum(o.usage.model_extra["speculative"]["accepted_tokens"] for o in outs) > 0
    chunks = list(client.chat.completions.create(
        model=openai.NOT_GIVEN, messages=[{"role": "user", "content": "hello"}],
        max_tokens=8, stream=True, temperature=0))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    health = httpx.get(f"{served.url}/health").json()
    assert (health["verifiers"], health["drafters"], health["speculative"]) == (1, 1, True)


def test_status_shows_the_gateway_as_a_member(served) -> None:
    r = cli("status", "--json")
    assert r.returncode == 0, r.stderr
    members = json.loads(r.stdout)["members"]
    assert sorted(m["role"] for m in members) == ["drafter", "gateway", "verifier"]
    gateway = next(m for m in members if m["role"] == "gateway")
    assert gateway["state"] == "ready" and gateway["pid"] == served.proc.pid
    assert f"http://{gateway['endpoint']}" == served.url
    assert gateway["metrics_url"] == f"{served.url}/metrics"


def test_scale_drafters_to_zero_from_another_process(served, client, model_dir, plain):
    r = cli("scale", "drafters", "0")
    assert r.returncode == 0, r.stderr
    assert wait_until(lambda: httpx.get(f"{served.url}/health").json()["drafters"] == 0, 30)
    assert httpx.get(f"{served.url}/health").json()["speculative"] is False
    outs = greedy(client, prompt_ids(model_dir, 3))
    assert [o.choices[0].text for o in outs] == plain  # plain decoding, same text
    assert all(o.usage.model_extra["speculative"]["draft_tokens"] == 0 for o in outs)


def test_down_from_another_process_stops_serve(served) -> None:
    r = cli("down")
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    served.proc.wait(60)
    assert served.proc.returncode == 0, served.output()
    assert "stopped from elsewhere" in served.output() and time.monotonic() - t0 < 60
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served.url}/health")

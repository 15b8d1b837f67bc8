"""A plain Llama target as a new user has one (random weights written by `transformers`'
`save_pretrained`, no MTP modules) behind `chainspec serve` on the session's Ray: the
stack comes up with 0 drafters and a warning that names `chainspec train-mtp`, answers
with plain greedy's text, reports max_model_len = min(max_len, max_position_embeddings)
less the K + 1 verify window, refuses a prompt past it (400 context_length_exceeded) and
ends a longer request there; `chainspec scale drafters 1` fails non-zero with the reason
and starts nothing. The demo model's /v1/models says its 512 positions, not its 1024
slots. Tests run in file order; the last stops the stack."""

from __future__ import annotations

import json

import httpx
import pytest

from chainspec.engine.local import DEMO_MODEL, LocalOptions
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.membership import StaticVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier
from tests.integration import helpers
from tests.integration.helpers import plain_outputs, prompt_ids, start_serve
from tests.integration.tiny_checkpoint import write_hf_model

pytestmark = pytest.mark.timeout(300)
NS = "chainspec-plain-target"
K, POSITIONS, TOKENS = 3, 512, 16
CONTEXT = POSITIONS - 1 - K  # slots of 1024 rows: the model's positions bound it


def cli(*args: str):
    return helpers.cli(NS, *args)


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("plain-llama"))


@pytest.fixture(scope="module")
def served(ray_cluster, plain_model):
    s = start_serve(plain_model, NS, "--max-len", "1024", "-k", str(K))
    yield s
    if s.proc.poll() is None:
        cli("down")
        s.proc.wait(60)


def complete(url: str, prompt, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_comes_up_plain_and_says_so(served) -> None:
    out = served.output()
    assert "chainspec serve: warning:" in out and "declares no MTP modules" in out, out
    assert "`chainspec train-mtp`" in out and "Traceback" not in out, out
    assert "ready: 1 verifier(s), 0 drafter(s) connected (no drafters: plain decoding)" \
        in out, out
    r = cli("status", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(m["role"] for m in json.loads(r.stdout)["members"]) == ["gateway",
                                                                          "verifier"]


def test_answers_with_plain_greedy(served, plain_model) -> None:
    prompts = prompt_ids(plain_model, 3)
    want = plain_outputs(plain_model, prompts, TOKENS)
    tok = Tokenizer.from_dir(plain_model)
    for prompt, tokens in zip(prompts, want, strict=True):
        r = complete(served.url, prompt, TOKENS)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(tokens)
        assert r.json()["usage"]["speculative"]["draft_tokens"] == 0


def test_context_is_the_models_positions(served) -> None:
    models = httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"]
    assert [m["max_model_len"] for m in models] == [CONTEXT]
    r = complete(served.url, [5] * CONTEXT, 1)  # no room left to generate
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and f"context of {CONTEXT}" in \
        err["message"], err
    r = complete(served.url, [5] * 480, 100)  # asks past the context: ends there
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == CONTEXT


def test_scale_drafters_fails_with_the_reason(served) -> None:
    r = cli("scale", "drafters", "1")
    assert r.returncode == 1, r.stdout
    assert "cannot add drafters" in r.stderr and "`chainspec train-mtp`" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    r = cli("status", "--json")
    assert "drafter" not in {m["role"] for m in json.loads(r.stdout)["members"]}


def test_down_stops_it(served) -> None:
    r = cli("down")
    assert r.returncode == 0, r.stderr
    served.proc.wait(60)
    assert served.proc.returncode == 0, served.output()


def test_demo_models_max_model_len_is_its_positions(loop_thread) -> None:
    """1024 slots (the default) on the 512-position demo model."""
    opts = VerifierOptions(LocalOptions(model_dir=DEMO_MODEL, num_steps=K, max_seqs=1))
    verifier = loop_thread.run(serve_verifier(opts, ServerOptions()))
    gateway = loop_thread.run(GatewayServer.start(GatewayConfig(port=0, refresh_interval_s=0.2),
                                                  StaticVerifiers([verifier.address])))
    try:
        assert loop_thread.run(gateway.wait_ready(30))
        models = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("demo", CONTEXT)]
    finally:
        loop_thread.run(gateway.stop())
        loop_thread.run(verifier.stop())

"""`chainspec serve org/name` with HF_HUB_OFFLINE=1 serves the model from a Hugging Face
cache laid out as huggingface_hub writes it (blobs, refs/main, snapshots linking into
blobs): the demo model cached under a Hub id answers as the demo model does, under the
Hub id's name; a Hub id that is not cached is one line before anything starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
import ray

from chainspec.engine.local import DEMO_MODEL
from chainspec.models.tokenizer import Tokenizer
from tests.hf_cache import add_to_cache
from tests.integration.helpers import Process, plain_outputs, stop_serve

pytestmark = pytest.mark.timeout(300)
NS = "chainspec-hub-test"
REPO = "chainspec-test/demo-mtp"
PROMPT = "The quick brown fox"
TOKENS = 16


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    return cache, add_to_cache(cache, REPO, DEMO_MODEL)


@pytest.fixture
def offline(monkeypatch, hub_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache[0]))


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def serve_positional(model: str, *extra: str) -> Process:
    """`chainspec serve MODEL` (vLLM's positional form) on the session's Ray."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    served = Process([sys.executable, "-m", "chainspec.cli", "serve", model,
                      "--address", ray.get_runtime_context().gcs_address, "--namespace", NS,
                      "--port", str(port), "--max-model-len", "256", "--timeout", "240",
                      *extra], dict(os.environ))
    served.url = f"http://127.0.0.1:{port}"
    served.wait_for("Ctrl-C stops it.", 240)
    return served


def test_serve_a_cached_hub_id_offline(ray_cluster, hub_cache, offline):
    served = serve_positional(REPO, "--max-num-seqs", "4", "-k", "2")
    try:
        assert "Ctrl-C stops it." in served.output(), served.output()
        with urllib.request.urlopen(f"{served.url}/v1/models", timeout=30) as r:
            models = [m["id"] for m in json.loads(r.read())["data"]]
        assert models == [REPO]  # the Hub id, not the snapshot's commit hash
        body = post(f"{served.url}/v1/completions",
                    {"model": REPO, "prompt": PROMPT, "max_tokens": TOKENS,
                     "temperature": 0, "ignore_eos": True})
    finally:
        stop_serve(served, NS, 60)
    tok = Tokenizer.from_dir(DEMO_MODEL)
    [expected] = plain_outputs(DEMO_MODEL, [tok.encode(PROMPT)], TOKENS)
    assert body["usage"]["completion_tokens"] == TOKENS
    assert body["choices"][0]["text"] == tok.decode(expected)


def test_an_uncached_hub_id_offline_is_one_line(offline):
    proc = subprocess.run([sys.executable, "-m", "chainspec.cli", "serve",
                           "chainspec-test/not-cached", "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "chainspec-test/not-cached" in lines[0] and \
        "not in the Hugging Face cache" in lines[0], proc.stderr

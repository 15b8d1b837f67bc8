"""`chainspec serve --token-file T --api-key-file K` serves the official `openai` client,
streamed and whole, completions and chat (the streaming `Generate` once went out without
the service token: every request got 401 "the verifier refused the gateway"), and the
token really guards every member: a gRPC call without it is UNAUTHENTICATED."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import openai
import pytest

from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.generated.v1 import verifier_pb2_grpc as pb_grpc
from tests.integration.helpers import plain_outputs, prompt_ids, start_serve

pytestmark = pytest.mark.timeout(300)
NS = "chainspec-serve-token-test"
TOKEN, API_KEY = "service-token-7f3a", "sk-user-key-91c2"


@pytest.fixture(scope="module")
def served(ray_cluster, model_dir, tmp_path_factory):
    import ray
    secrets = tmp_path_factory.mktemp("secrets")
    (secrets / "token").write_text(TOKEN + "\n")
    (secrets / "key").write_text(API_KEY + "\n")
    s = start_serve(model_dir, NS, "--token-file", str(secrets / "token"),
                    "--api-key-file", str(secrets / "key"))
    yield s
    s.proc.terminate()
    s.proc.wait(60)
    if s.proc.returncode != 0:
        subprocess.run([sys.executable, "-m", "chainspec.cli", "down", "--namespace", NS,
                        "--address", ray.get_runtime_context().gcs_address],
                       capture_output=True, timeout=120, env=os.environ)


@pytest.fixture(scope="module")
def plain(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    return tok.decode(plain_outputs(model_dir, prompt_ids(model_dir, 1), 16)[0])


def _client(served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)


def test_the_openai_client_is_served_streamed_and_whole(served, plain) -> None:
    client = _client(served, API_KEY)
    prompt = "def fibonacci(n):"
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert whole.choices[0].text == streamed == plain
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)


def test_a_wrong_api_key_is_refused(served) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(served, "sk-wrong").completions.create(model="x", prompt="a", max_tokens=2)


def test_members_refuse_calls_without_the_service_token(served) -> None:
    out = subprocess.run([sys.executable, "-m", "chainspec.cli", "status", "--json",
                          "--namespace", NS], capture_output=True, text=True, timeout=120,
                         env=os.environ)
    assert out.returncode == 0, out.stderr
    assert TOKEN not in out.stdout + out.stderr
    members = json.loads(out.stdout)["members"]
    verifier = next(m for m in members if m["role"] == "verifier")
    for token in (None, "wrong-token"):
        channel = grpc.insecure_channel(verifier["endpoint"])
        metadata = [("authorization", f"Bearer {token}")] if token else None
        try:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.VerifierStub(channel).Info(pb.VerifierInfoRequest(), timeout=10,
                                                   metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            channel.close()

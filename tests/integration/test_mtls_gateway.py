"""mTLS and the service token on every hop at once, end to end: drafter and verifier
require client certificates and the token; their certificate names a service rather than
the address clients dial (as pods dial each other's IPs); the verifier reaches its drafter
with its own certificate, and the gateway reaches the verifier with its certificate over
the unary (Info, health) and server-streaming (Generate) calls, serving the official
`openai` client speculatively with plain decoding's greedy output. A gateway without its
client certificate, the token or the server name serves nothing."""

from __future__ import annotations

import dataclasses

import openai
import pytest

from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import LocalOptions
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.membership import StaticVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.models.loader import load_draft_model
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.channel import ClientOptions
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier
from tests.integration.certs import make_ca, make_leaf
from tests.integration.helpers import plain_outputs, prompt_ids

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.usefixtures("openssl")]
TOKEN, KEY, TOKENS = "svc-token-e2e", "sk-e2e", 16
SERVER_NAME = "chainspec-workers.internal"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_ca(d, "ca")
    # NOTE: valid for a service name only, not the 127.0.0.1 every client dials (as pods
    # dial each other's IPs): clients must check the name given by tls_server_name
    make_leaf(d, "server", "ca", f"subjectAltName=DNS:{SERVER_NAME}\n"
              "extendedKeyUsage=serverAuth\n")
    make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture(scope="module")
def services(model_dir, loop_thread, certs):
    server = ServerOptions(tls_cert=certs / "server.pem", tls_key=certs / "server.key",
                           tls_client_ca=certs / "ca.pem", auth_token=TOKEN)
    client = ClientOptions(tls_ca=certs / "ca.pem", tls_cert=certs / "client.pem",
                           tls_key=certs / "client.key", auth_token=TOKEN,
                           tls_server_name=SERVER_NAME)
    engine = DrafterEngine(load_draft_model(model_dir, cache_len=256),
                           DrafterConfig(num_steps=3, max_seqs=16, max_len=256))
    drafter = loop_thread.run(serve_drafter(engine, server, "tiny"))
    opts = LocalOptions(model_dir=model_dir, num_steps=3, max_seqs=8, max_len=256)
    verifier = loop_thread.run(serve_verifier(VerifierOptions(opts), server,
                                              [drafter.address], client))
    yield verifier, client
    loop_thread.run(verifier.stop())
    loop_thread.run(drafter.stop())


def _gateway(loop_thread, verifier, client: ClientOptions) -> GatewayServer:
    config = GatewayConfig(port=0, refresh_interval_s=0.2, api_key=KEY)
    return loop_thread.run(GatewayServer.start(config, StaticVerifiers([verifier.address]),
                                               client=client))


def test_the_openai_client_is_served_over_mtls_with_the_token(loop_thread, services,
                                                              model_dir) -> None:
    verifier, client = services
    gateway = _gateway(loop_thread, verifier, client)
    try:
        assert loop_thread.run(gateway.wait_ready(30, drafters=1)), "never ready over mTLS"
        prompt = prompt_ids(model_dir, 1)[0]
        plain = Tokenizer.from_dir(model_dir).decode(
            plain_outputs(model_dir, [prompt], TOKENS)[0])
        api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
        model = api.models.list().data[0].id
        args = dict(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0,
                    extra_body={"ignore_eos": True})
        whole = api.completions.create(**args)
        streamed = "".join(c.choices[0].text for c in api.completions.create(**args,
                                                                            stream=True))
        assert whole.choices[0].text == streamed == plain
        assert verifier.drafts.stats.batches_sent > 0, "the verifier drafted over mTLS"
    finally:
        loop_thread.run(gateway.stop())


@pytest.mark.parametrize("missing", ["certificate", "token", "server name"])
def test_a_gateway_without_credentials_serves_nothing(loop_thread, services, missing) -> None:
    verifier, client = services
    bare = dataclasses.replace(client, **{"certificate": dict(tls_cert=None, tls_key=None),
                                          "token": dict(auth_token=None),
                                          "server name": dict(tls_server_name=None)}[missing])
    gateway = _gateway(loop_thread, verifier, bare)
    try:
        api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as err:
            api.completions.create(model="tiny-model", prompt="a", max_tokens=2)
        assert getattr(err.value, "status_code", 503) in (401, 503)
    finally:
        loop_thread.run(gateway.stop())

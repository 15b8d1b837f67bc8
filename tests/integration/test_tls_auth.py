"""TLS, mTLS and the shared token on real servers, with certificates made here by the
openssl command line (a throwaway CA, a server and a client certificate, and a rogue CA
with its own client certificate)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from chainspec.engine.draft_types import ErrorCode, SeqFailure, SeqUpdate
from chainspec.rpc.channel import ClientOptions, make_aio_channel, make_channel
from chainspec.rpc.draft_pool import GrpcDraftClient, LinkState
from chainspec.rpc.generated.v1 import drafter_pb2 as pb
from chainspec.rpc.generated.v1 import drafter_pb2_grpc as pb_grpc
from chainspec.rpc.server import ServerOptions
from tests.integration.certs import make_ca, make_leaf
from tests.integration.grpc_helpers import DraftStream, drafter_engine, start_drafter
from tests.unit.engine_fixtures import tied_pair

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.usefixtures("openssl")]
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    make_ca(d, "ca")
    make_ca(d, "rogue-ca")
    make_leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
          "extendedKeyUsage=serverAuth\n")
    make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    make_leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture(scope="module")
def draft():
    return tied_pair()[1]


def _server(loop, draft, **opts):
    return start_drafter(loop, drafter_engine(draft), **opts)


def _info(target: str, opts: ClientOptions) -> pb.DrafterInfo:
    channel = make_channel(target, opts)
    try:
        return pb_grpc.DrafterStub(channel).Info(pb.DrafterInfoRequest(), timeout=5)
    finally:
        channel.close()


def _refused(target: str, opts: ClientOptions) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        _info(target, opts)
    return err.value.code()


def test_mtls_requires_a_valid_client_certificate(loop, draft, certs) -> None:
    srv = _server(loop, draft, tls_cert=certs / "server.pem", tls_key=certs / "server.key",
                  tls_client_ca=certs / "ca.pem")
    addr, ca = srv.address, certs / "ca.pem"
    try:
        good = ClientOptions(tls_ca=ca, tls_cert=certs / "client.pem",
                             tls_key=certs / "client.key")
        assert _info(addr, good).model_name == "tiny"
        assert _refused(addr, ClientOptions(tls_ca=ca)) == grpc.StatusCode.UNAVAILABLE
        rogue = ClientOptions(tls_ca=ca, tls_cert=certs / "rogue.pem",
                              tls_key=certs / "rogue.key")
        assert _refused(addr, rogue) == grpc.StatusCode.UNAVAILABLE
        assert _refused(addr, ClientOptions()) == grpc.StatusCode.UNAVAILABLE  # plaintext
    finally:
        loop.run(srv.stop(0))


def test_client_checks_the_server_certificate(loop, draft, certs) -> None:
    srv = _server(loop, draft, tls_cert=certs / "server.pem", tls_key=certs / "server.key")
    try:
        assert _info(srv.address, ClientOptions(tls_ca=certs / "ca.pem")).hidden_size == 32
        wrong_ca = ClientOptions(tls_ca=certs / "rogue-ca.pem")
        assert _refused(srv.address, wrong_ca) == grpc.StatusCode.UNAVAILABLE
    finally:
        loop.run(srv.stop(0))


def test_shared_token(loop, draft) -> None:
    srv = _server(loop, draft, auth_token=TOKEN)
    addr = srv.address
    try:
        assert _info(addr, ClientOptions(auth_token=TOKEN)).model_name == "tiny"
        for opts in (ClientOptions(), ClientOptions(auth_token="wrong")):
            assert _refused(addr, opts) == grpc.StatusCode.UNAUTHENTICATED
            stream = DraftStream(addr, opts)
            with pytest.raises(grpc.RpcError) as err:
                stream.ask(pb.DraftRequest(batch_id=1))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stream.channel.close()
        stream = DraftStream(addr, ClientOptions(auth_token=TOKEN))
        assert stream.ask(pb.DraftRequest(batch_id=3)).batch_id == 3
        stream.close()
        channel = make_channel(addr)  # no token: probes still work, reflection does not
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
    finally:
        loop.run(srv.stop(0))


def test_token_over_mtls_on_an_asyncio_channel(loop, draft, certs) -> None:
    srv = _server(loop, draft, tls_cert=certs / "server.pem", tls_key=certs / "server.key",
                  tls_client_ca=certs / "ca.pem", auth_token=TOKEN)
    tls = dict(tls_ca=certs / "ca.pem", tls_cert=certs / "client.pem",
               tls_key=certs / "client.key")

    async def info(token: str) -> grpc.StatusCode:
        async with make_aio_channel(srv.address, ClientOptions(auth_token=token, **tls)) as ch:
            try:
                await pb_grpc.DrafterStub(ch).Info(pb.DrafterInfoRequest(), timeout=5)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                return e.code()

    try:
        assert loop.run(info(TOKEN)) == grpc.StatusCode.OK
        assert loop.run(info("nope")) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        loop.run(srv.stop(0))


def test_draft_pool_over_mtls_with_token(loop, draft, certs) -> None:
    """The verifier's client connects with the right credentials and refuses to use a
    drafter it cannot talk to (its sequences get UNAVAILABLE, never a hang)."""
    srv = _server(loop, draft, tls_cert=certs / "server.pem", tls_key=certs / "server.key",
                  tls_client_ca=certs / "ca.pem", auth_token=TOKEN)
    tls = dict(tls_ca=certs / "ca.pem", tls_cert=certs / "client.pem",
               tls_key=certs / "client.key")
    update = SeqUpdate(1, 0, (1, 2, 3), torch.randn(3, 32))
    good = GrpcDraftClient([srv.address], ClientOptions(auth_token=TOKEN, **tls),
                           round_deadline_s=5.0)
    bad = GrpcDraftClient([srv.address], ClientOptions(auth_token="nope", **tls),
                          connect_timeout_s=2.0)
    try:
        assert good.states() == {srv.address: LinkState.LIVE}
        good.submit([update])
        assert good.collect()[1].position == 3
        assert bad.states() == {srv.address: LinkState.DEAD}
        bad.submit([update])
        (failure,) = bad.collect().values()
        assert isinstance(failure, SeqFailure) and failure.code is ErrorCode.UNAVAILABLE
    finally:
        good.close()
        bad.close()
        loop.run(srv.stop(0))


@pytest.mark.parametrize("kwargs,message", [
    (dict(tls_key=Path("k")), "go together"),
    (dict(tls_client_ca=Path("ca")), "needs tls_cert"),
    (dict(auth_token=" "), "must not be empty"),
    (dict(port=70000), "port"),
    (dict(max_message_bytes=10), "max_message_bytes"),
])
def test_server_options_are_validated(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ServerOptions(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tls_cert=Path("c")), "go together"),
    (dict(tls_cert=Path("c"), tls_key=Path("k")), "needs TLS"),
    (dict(auth_token=""), "must not be empty"),
])
def test_client_options_are_validated(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ClientOptions(**kwargs)


def test_missing_certificate_file_is_a_clear_error(loop, draft, tmp_path) -> None:
    with pytest.raises(OSError, match=r"tls_(cert|key): cannot read .*none"):
        _server(loop, draft, tls_cert=tmp_path / "none.pem", tls_key=tmp_path / "none.key")


def test_token_on_every_call_kind_of_an_asyncio_channel(loop, draft) -> None:
    """grpc.aio files an interceptor under the first call kind it implements, so one
    object for all four kinds sent the token on unary calls only; each kind is checked
    here: unary (Info), bidi stream (Draft) and bidi reflection."""
    srv = _server(loop, draft, auth_token=TOKEN)

    async def calls(token: str | None) -> list[grpc.StatusCode]:
        codes = []
        opts = ClientOptions(auth_token=token) if token else ClientOptions()
        async with make_aio_channel(srv.address, opts) as ch:
            async def code(make) -> None:
                try:
                    await make()
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())

            # NOTE: a refused stream is opened without writing: a client write that
            # races the server's status is reported as INTERNAL by grpc.aio (grpc#36066)
            def sent(request):
                return iter([request]) if token else None

            async def draft_stream():
                async for _ in pb_grpc.DrafterStub(ch).Draft(sent(pb.DraftRequest(batch_id=1)),
                                                              timeout=5):
                    pass

            async def reflect():
                stub = reflection_pb2_grpc.ServerReflectionStub(ch)
                req = reflection_pb2.ServerReflectionRequest(list_services="")
                async for _ in stub.ServerReflectionInfo(sent(req), timeout=5):
                    pass
            await code(lambda: pb_grpc.DrafterStub(ch).Info(pb.DrafterInfoRequest(), timeout=5))
            await code(draft_stream)
            await code(reflect)
        return codes

    try:
        assert loop.run(calls(TOKEN)) == [grpc.StatusCode.OK] * 3
        assert loop.run(calls(None)) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    finally:
        loop.run(srv.stop(0))

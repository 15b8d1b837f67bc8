"""`chainspec health` against real gRPC servers (rpc/server.py start_server, no engine):
the exit status follows the server's health, and TLS/mTLS are checked as the services'
own clients check them, so an exec probe passes only when a real client would connect.
Certificates come from test_tls_auth's openssl helpers."""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys
import time

import pytest

from chainspec import cli
from chainspec.rpc.server import ServerOptions, start_server
from tests.integration.certs import make_ca, make_leaf

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.usefixtures("openssl")]
SERVICE = "test.v1.Thing"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    make_ca(d, "ca")
    make_ca(d, "rogue-ca")
    make_leaf(d, "server", "ca", "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n")
    make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    make_leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return d


@pytest.fixture
def serve(loop_thread):
    """Start a server with health only; stopped after the test."""
    started = []

    def start(serving: bool = True, **opts):
        srv = loop_thread.run(start_server(ServerOptions(**opts), lambda _server: None,
                                           (SERVICE,)))
        started.append(srv)
        if serving:
            loop_thread.run(srv.set_serving(True))
        return srv
    yield start
    for srv in started:
        loop_thread.run(srv.stop(0))


def health(*argv: str) -> tuple[int, str]:
    """`chainspec health ARGV` through the real CLI: exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["health", *argv])
    return rc, err.getvalue()


def test_exit_status_follows_health(serve, loop_thread):
    srv = serve(serving=False)  # a server starts NOT_SERVING until warmed up
    rc, err = health("--address", srv.address)
    assert (rc, err.count("\n")) == (1, 1) and "NOT_SERVING" in err
    loop_thread.run(srv.set_serving(True))
    assert health("--address", srv.address) == (0, "")
    assert health("--address", srv.address, "--service", SERVICE) == (0, "")
    rc, err = health("--address", srv.address, "--service", "no.Such")
    assert rc == 1 and "unknown service 'no.Such'" in err
    loop_thread.run(srv.drain())  # draining (then stopped): a probe must fail
    assert health("--address", srv.address)[0] == 1


def test_unreachable_and_silent_servers_fail_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        rc, err = health("--address", f"127.0.0.1:{port}")  # bound, not listening
        assert rc == 1 and "unreachable: UNAVAILABLE" in err
        s.listen()  # the kernel completes the TCP handshake; nobody speaks HTTP/2
        t0 = time.monotonic()
        rc, err = health("--address", f"127.0.0.1:{port}", "--timeout", "0.5")
        assert rc == 1 and "DEADLINE_EXCEEDED" in err
        assert time.monotonic() - t0 < 5


def test_tls_checks_the_server_certificate_and_name(serve, certs):
    srv = serve(tls_cert=certs / "server.pem", tls_key=certs / "server.key")
    # dial the loopback IP, check the name the certificate lists (as the chart's probes do)
    base = ("--address", f"127.0.0.1:{srv.port}", "--tls-server-name", "localhost")
    assert health(*base, "--tls-ca", str(certs / "ca.pem")) == (0, "")
    rc, err = health(*base, "--tls-ca", str(certs / "rogue-ca.pem"))
    assert rc == 1 and "unreachable" in err
    rc, _ = health("--address", f"127.0.0.1:{srv.port}", "--tls-ca", str(certs / "ca.pem"))
    assert rc == 1, "127.0.0.1 is not a name in the server certificate"
    assert health("--address", f"127.0.0.1:{srv.port}")[0] == 1  # plaintext to TLS


def test_mtls_needs_a_client_certificate_the_server_trusts(serve, certs):
    srv = serve(tls_cert=certs / "server.pem", tls_key=certs / "server.key",
                tls_client_ca=certs / "ca.pem", auth_token="s3cret")
    base = ("--address", f"127.0.0.1:{srv.port}", "--tls-server-name", "localhost",
            "--tls-ca", str(certs / "ca.pem"))
    rc, err = health(*base)
    assert rc == 1 and "unreachable" in err
    rogue = ("--tls-cert", str(certs / "rogue.pem"), "--tls-key", str(certs / "rogue.key"))
    assert health(*base, *rogue)[0] == 1
    client = ("--tls-cert", str(certs / "client.pem"), "--tls-key", str(certs / "client.key"))
    assert health(*base, *client) == (0, ""), "health needs no token, only the certificate"


def test_bad_arguments_fail_without_checking(certs):
    assert health("--address", "nohost", "--dry-run")[0] == 2
    assert health("--address", "h:1", "--tls-server-name", "x", "--dry-run")[0] == 2
    assert health("--address", "h:1", "--tls-cert", str(certs / "client.pem"),
                  "--dry-run")[0] == 2  # a certificate without its key
    rc, err = health("--address", "127.0.0.1:1", "--tls-ca", str(certs / "missing.pem"))
    assert rc == 2 and "missing.pem" in err


def test_module_entry_point_is_the_same_command_without_torch(serve, certs):
    """The chart's probes run `python -m chainspec.commands.health`: same arguments and
    exit status as `chainspec health`, and no torch import (a probe runs every few
    seconds beside the model)."""
    srv = serve(tls_cert=certs / "server.pem", tls_key=certs / "server.key",
                tls_client_ca=certs / "ca.pem")
    argv = ["--address", f"127.0.0.1:{srv.port}", "--tls-server-name", "localhost",
            "--tls-ca", str(certs / "ca.pem")]
    entry = [sys.executable, "-m", "chainspec.commands.health", *argv]

    def probe(cert: str, key: str) -> subprocess.CompletedProcess:
        return subprocess.run([*entry, "--tls-cert", str(certs / cert), "--tls-key",
                               str(certs / key)], capture_output=True, text=True, timeout=30)
    ok = probe("client.pem", "client.key")
    assert (ok.returncode, ok.stderr) == (0, "")
    for cert, key in (("rogue.pem", "rogue.key"), ("client.pem", "rogue.key")):
        refused = probe(cert, key)  # another CA's client; a key not of the certificate
        assert refused.returncode == 1, (cert, key)
        assert refused.stderr.startswith("chainspec health:") \
            and refused.stderr.count("\n") == 1, f"one line, no gRPC core log: {refused.stderr}"
    imports = ("import sys, runpy; sys.argv = ['health', '--address', 'h:1', '--dry-run']\n"
               "try: runpy.run_module('chainspec.commands.health', run_name='__main__')\n"
               "except SystemExit as e: assert e.code == 0, e.code\n"
               "heavy = sorted({'torch', 'ray', 'numpy'} & set(sys.modules))\n"
               "assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr

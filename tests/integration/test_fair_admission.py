"""Fair admission end to end (HTTP gateway -> gRPC verifier -> gRPC drafter, in process):
one client's n = 16 x 500-token request, or four such streams opened and never read,
cannot make another client's 8-token probe wait for their sequences. The verifier runs 8
sequences (the red-team setup of issue 19), so one n = 16 request is twice its capacity
and four are eight times. Latencies are bounds and ratios against the same probe run
alone, never exact timings.

NOTE: with more heavy requests than slots (each then holds one), a newcomer waits for the
next sequence to end: admission has no time slicing (docs/design.md, "Fair admission")."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import LocalOptions
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.membership import StaticVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.models.loader import load_draft_model
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier
from tests.integration.helpers import wait_for

pytestmark = pytest.mark.timeout(300)
K, MAX_LEN, MAX_SEQS = 3, 512, 8
PROBE = {"prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
BIG = {"prompt": "def fibonacci(n):", "n": 16, "max_tokens": 500, "temperature": 0.8,
       "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def stack(model_dir, loop_thread):
    engine = DrafterEngine(load_draft_model(model_dir, cache_len=MAX_LEN),
                           DrafterConfig(num_steps=K, max_seqs=64, max_len=MAX_LEN))
    drafter = loop_thread.run(serve_drafter(engine, ServerOptions(), "tiny"))
    opts = LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=MAX_SEQS, max_len=MAX_LEN)
    verifier = loop_thread.run(serve_verifier(VerifierOptions(opts, max_waiting=80),
                                              ServerOptions(), [drafter.address]))
    gateway = loop_thread.run(GatewayServer.start(
        GatewayConfig(port=0, refresh_interval_s=0.2), StaticVerifiers([verifier.address])))
    assert loop_thread.run(gateway.wait_ready(30, drafters=1))
    yield gateway, verifier
    loop_thread.run(gateway.stop())
    loop_thread.run(verifier.stop())
    loop_thread.run(drafter.stop())


def open_stream(url: str, body: dict, read: bool) -> socket.socket:
    """A raw HTTP/1.1 POST whose response is drained by a thread (`read`) or never read
    (a small receive buffer, so the server's writes back up soon)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if not read:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    if read:
        threading.Thread(target=_drain, args=(sock,), daemon=True).start()
    return sock


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


def probe(client: httpx.Client) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=PROBE)
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    return took


def worst_of_three(client: httpx.Client) -> float:
    return max(probe(client) for _ in range(3))


def idle(verifier) -> None:
    wait_for(lambda: verifier.load == 0, 120, "the verifier to finish the aborted load")


def loaded_probes(stack, bodies: list[dict], read: bool) -> tuple[float, float, int]:
    """(worst probe alone, worst probe under the load, running sequences of the load
    when the probes began)."""
    gateway, verifier = stack
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        probe(client)  # warm: the first request pays one-off costs
        alone = worst_of_three(client)
        socks = [open_stream(gateway.url, b, read) for b in bodies]
        try:
            time.sleep(1.0)  # the first probe goes a second after the load
            held = verifier.engine.running
            loaded = worst_of_three(client)
        finally:
            for s in socks:
                s.close()
    idle(verifier)
    print(f"probe alone {alone:.3f} s, under load {loaded:.3f} s ({loaded / alone:.1f}x)")
    return alone, loaded, held


def test_n_over_max_n_is_a_400_naming_n_and_the_cap(stack) -> None:
    gateway, _ = stack
    r = httpx.post(f"{gateway.url}/v1/completions", json={**PROBE, "n": 17}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "n" and "at most 16" in err["message"] and "--max-n" in err["message"]


def test_n16_request_raises_a_probe_at_most_3x_or_to_1s(stack) -> None:
    alone, loaded, held = loaded_probes(stack, [BIG], read=True)
    assert held == MAX_SEQS  # the big request really had every slot when the probe came
    assert loaded <= max(3 * alone, 1.0)


def test_four_unread_n16_streams_keep_a_probe_under_5s(stack) -> None:
    alone, loaded, held = loaded_probes(stack, [BIG] * 4, read=False)
    assert held == MAX_SEQS
    assert loaded <= 5.0

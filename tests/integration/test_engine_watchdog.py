"""Health tells the truth about the verifier's engine: 300 hit-and-run hang-ups beside
busy streams leave it alive and serving exactly, an engine thread that dies anyway turns
health NOT_SERVING within 2 s and tells the host why, and a stuck step does the same."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chainspec.engine.local import LocalOptions
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VERIFIER_SERVICE, VerifierOptions, serve_verifier
from tests.integration.helpers import generate, plain_outputs, prompt_ids, verifier_stub

pytestmark = pytest.mark.timeout(180)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True))
    req.tokens.ids.extend(prompt)
    return req


def _verifier(loop_thread, model_dir, **opts):
    failures: list[str] = []
    verifier = loop_thread.run(serve_verifier(
        VerifierOptions(LocalOptions(model_dir=model_dir, num_steps=3, max_seqs=8,
                                     max_len=256), **opts),
        ServerOptions(), on_failure=failures.append))
    return verifier, failures


def _health(address: str) -> int:
    channel = grpc.insecure_channel(address)
    try:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE), timeout=2).status
    finally:
        channel.close()


def _wait_not_serving(address: str, limit_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if _health(address) == NOT_SERVING:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"health still SERVING after {limit_s} s")


def test_hit_and_run_hang_ups_leave_the_engine_serving(loop_thread, model_dir) -> None:
    """Clients that open a stream and hang up 0-60 ms later, 300 times, beside 8 busy
    streams (the red-team recipe that killed the engine in 5 tries)."""
    verifier, failures = _verifier(loop_thread, model_dir)
    channel, stub = verifier_stub(verifier.address)
    prompts = prompt_ids(model_dir, 8)
    plain = plain_outputs(model_dir, prompts, max_tokens=48)
    results: dict[int, list[list[int]]] = {i: [] for i in range(8)}
    errors: list[BaseException] = []

    def busy(i: int) -> None:
        try:
            for _ in range(3):
                results[i].append(generate(stub, prompts[i], max_tokens=48).tokens)
        except BaseException as e:  # reported below
            errors.append(e)
    try:
        threads = [threading.Thread(target=busy, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for n in range(300):
            call = stub.Generate(_request(prompts[n % 8], 64))
            time.sleep((n % 7) * 0.01)  # 0..60 ms
            call.cancel()
        for t in threads:
            t.join(120)
        assert not errors, errors[:3]
        assert [results[i] for i in range(8)] == [[p] * 3 for p in plain]  # all 24
        assert verifier.engine.alive and verifier.failure is None and not failures
        assert _health(verifier.address) == SERVING
        assert generate(stub, prompts[0], max_tokens=48).tokens == plain[0]
    finally:
        channel.close()
        loop_thread.run(verifier.stop())


def test_a_dead_engine_thread_turns_health_not_serving(loop_thread, model_dir) -> None:
    verifier, failures = _verifier(loop_thread, model_dir)
    channel, stub = verifier_stub(verifier.address)
    try:
        assert _health(verifier.address) == SERVING

        def broken_step():
            raise RuntimeError("injected engine fault")
        verifier.engine.engine.step = broken_step
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, [1, 2, 3], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        took = _wait_not_serving(verifier.address, 2.0)
        assert failures and "injected engine fault" in failures[0]
        assert verifier.failure == failures[0]
        print(f"NOT_SERVING {took:.2f} s after the engine died")
    finally:
        channel.close()
        loop_thread.run(verifier.stop())


def test_a_stuck_engine_step_turns_health_not_serving(loop_thread, model_dir) -> None:
    verifier, failures = _verifier(loop_thread, model_dir, stall_limit_s=0.5)
    channel, stub = verifier_stub(verifier.address)
    release = threading.Event()
    try:
        step = verifier.engine.engine.step

        def stuck_step():
            release.wait(30)
            return step()
        verifier.engine.engine.step = stuck_step
        call = stub.Generate(_request([1, 2, 3], 4))
        _wait_not_serving(verifier.address, 3.0)
        assert failures and "no progress" in failures[0]
        call.cancel()
    finally:
        release.set()
        channel.close()
        loop_thread.run(verifier.stop())

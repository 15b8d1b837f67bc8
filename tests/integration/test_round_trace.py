"""A draft round over real gRPC, traced on both sides (`RoundTrace`), and the drafter's
threading: every touch of the engine happens on the server loop's thread, streams
included, so a round costs no hop to a worker thread and back."""

from __future__ import annotations

import threading

import pytest
import torch

from chainspec.engine.draft_types import DraftResult, SeqUpdate, UpdateBatch
from chainspec.rpc.draft_codec import encode_draft_request
from chainspec.rpc.draft_pool import GrpcDraftClient
from chainspec.rpc.drafter_service import DRAFTER_SERVICE, DrafterServicer
from chainspec.rpc.round_trace import RoundTrace
from chainspec.rpc.server import ServerOptions, start_server
from tests.integration.grpc_helpers import DraftStream, drafter_engine
from tests.integration.helpers import LoopThread
from tests.unit.engine_fixtures import tied_pair

pytestmark = pytest.mark.timeout(60)
K = 3
VERIFIER_HOPS = ["v_send", "v_encoded", "v_pulled", "v_recv", "v_decoded"]
DRAFTER_HOPS = ["d_recv", "d_start", "d_decoded", "d_drafted", "d_encoded", "d_send"]


class ThreadSpy:
    """Records the thread of every call of the engine's `update` and `release`."""

    def __init__(self, engine) -> None:
        self.threads: set[int] = set()
        for name in ("update", "release"):
            real = getattr(engine, name)
            setattr(engine, name, self._spy(real))

    def _spy(self, real):
        def call(*args, **kw):
            self.threads.add(threading.get_ident())
            return real(*args, **kw)
        return call


@pytest.fixture(scope="module")
def served():
    loop = LoopThread()
    target, draft = tied_pair()
    engine = drafter_engine(draft, k=K)
    servicer = DrafterServicer(engine, "tiny")
    servicer.trace = RoundTrace()

    async def start():
        running = await start_server(ServerOptions(), servicer.register, [DRAFTER_SERVICE])
        await servicer.warm_up()
        await running.set_serving(True)
        return running
    running = loop.run(start())
    yield loop, servicer, target, running
    loop.run(running.stop(0))
    servicer.close()
    loop.close()


def _client(address: str, trace: RoundTrace | None = None) -> GrpcDraftClient:
    client = GrpcDraftClient(round_deadline_s=10.0, max_seqs=4)
    client.trace = trace  # before connecting: the stream's requests are marked too
    client.set_endpoints([address])
    assert client.wait_connected(10)
    return client


def _update(seq_id: int, start: int, n: int, hidden_size: int) -> SeqUpdate:
    return SeqUpdate(seq_id, start, tuple(range(1, n + 1)), torch.randn(n, hidden_size))


def test_every_hop_is_marked_in_order(served) -> None:
    loop, servicer, target, running = served
    servicer.trace.drain()
    trace = RoundTrace()
    client = _client(running.address, trace)
    try:
        client.submit([_update(1, 0, 5, target.config.hidden_size)])
        out = client.collect()
    finally:
        client.close()
    assert isinstance(out[1], DraftResult)
    marks = {hop: t for _, hop, t in [*trace.drain(), *servicer.trace.drain()]}
    order = VERIFIER_HOPS[:3] + DRAFTER_HOPS + VERIFIER_HOPS[3:]
    assert list(marks) != [] and set(order) <= set(marks)
    times = [marks[hop] for hop in order]
    assert times == sorted(times), dict(zip(order, times, strict=True))


def test_engine_is_touched_on_the_loop_thread_only(served) -> None:
    loop, servicer, target, running = served
    spy = ThreadSpy(servicer.engine)
    clients = [_client(running.address) for _ in range(2)]
    H = target.config.hidden_size

    def drive(client: GrpcDraftClient, seq_id: int) -> None:
        start = 0
        for n in (4, 2, 3, 1):
            client.submit([_update(seq_id, start, n, H)])
            assert isinstance(client.collect()[seq_id], DraftResult)
            start += n
        client.release([seq_id])
    threads = [threading.Thread(target=drive, args=(c, 10 + i)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in clients:
        c.close()  # the streams' cleanup releases on the loop too
    assert spy.threads == {loop.thread.ident}


def test_a_stream_waits_for_warm_up() -> None:
    """Warm-up runs off the loop (health answers meanwhile); a stream opened before it
    ends is answered only after it, so the engine never runs two rounds at once."""
    loop = LoopThread()
    target, draft = tied_pair()
    engine = drafter_engine(draft, k=K)
    servicer = DrafterServicer(engine, "tiny")
    spy = ThreadSpy(engine)
    running = loop.run(start_server(ServerOptions(), servicer.register, [DRAFTER_SERVICE]))
    stream = DraftStream(running.address)
    try:
        H = target.config.hidden_size
        request = encode_draft_request(UpdateBatch(1, (_update(1, 0, 3, H),)))
        answer = threading.Thread(target=lambda: got.append(stream.ask(request)))
        got: list = []
        answer.start()
        answer.join(0.5)
        assert got == [] and spy.threads == set()  # not answered before warm-up
        loop.run(servicer.warm_up())
        answer.join(10)
        assert got and got[0].results[0].WhichOneof("outcome") == "drafts"
        assert loop.thread.ident in spy.threads
    finally:
        stream.close()
        loop.run(running.stop(0))
        loop.close()

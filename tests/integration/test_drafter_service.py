"""The Drafter service over real gRPC: per-sequence errors beside a good sequence whose
drafts match an in-process engine, stream scoping, oversize, capacity, health through
warm-up and drain, reflection, Info."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from chainspec.engine.draft_types import DraftResult, DraftSampling, SeqUpdate, UpdateBatch
from chainspec.engine.fingerprint import model_fingerprint
from chainspec.rpc.channel import make_channel
from chainspec.rpc.draft_codec import encode_draft_request, encode_update
from chainspec.rpc.draft_pool import BUSY_HORIZON_S, GrpcDraftClient
from chainspec.rpc.drafter_service import DRAFTER_SERVICE, serve_drafter
from chainspec.rpc.generated.v1 import drafter_pb2 as pb
from chainspec.rpc.generated.v1 import drafter_pb2_grpc as pb_grpc
from chainspec.rpc.server import ServerOptions
from tests.integration.grpc_helpers import (
    DraftStream,
    drafter_engine,
    free_port,
    start_drafter,
    wait_until,
)
from tests.unit.engine_fixtures import tied_pair

pytestmark = pytest.mark.timeout(60)
H, V, K, MAX_LEN, MAX_BYTES = 32, 61, 3, 256, 64 * 1024
GOOD = 1000  # the good sequence's id in every stream
ERR = pb.ErrorCode


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


@pytest.fixture(scope="module")
def server(loop, pair):
    engine = drafter_engine(pair[1], k=K, max_len=MAX_LEN)
    running = start_drafter(loop, engine, max_message_bytes=MAX_BYTES)
    running.engine = engine
    yield running
    loop.run(running.stop(0))


def script(seq_id: int, rounds: int, seed: int, sampled: bool = False) -> list[SeqUpdate]:
    """A sequence's updates: a prefill, then rounds committing j + 1 rows (0 <= j <= K)."""
    gen = torch.Generator().manual_seed(seed)
    sampling = DraftSampling(0.8, 4, seed) if sampled else DraftSampling()
    out, start, n = [], 0, 6
    for _ in range(rounds + 1):
        tokens = tuple(torch.randint(0, V, (n,), generator=gen).tolist())
        out.append(SeqUpdate(seq_id, start, tokens, torch.randn(n, H, generator=gen),
                             sampling=sampling))
        start += n
        n = int(torch.randint(1, K + 2, (), generator=gen))
    return out


@dataclass
class Good:
    """The good sequence: its script, and an in-process engine's drafts for each step."""

    updates: list[SeqUpdate]
    expected: list[DraftResult] = field(default_factory=list)

    @classmethod
    def make(cls, draft, rounds: int, seed: int = 0, sampled: bool = False) -> Good:
        ref = drafter_engine(copy.deepcopy(draft), k=K, max_len=MAX_LEN)
        good = cls(script(GOOD, rounds, seed, sampled))
        good.expected = [ref.update([u])[0] for u in good.updates]
        return good

    def check(self, step: int, response: pb.DraftResponse) -> None:
        (got,) = [r.drafts for r in response.results if r.drafts.seq_id == GOOD]
        want = self.expected[step]
        assert got.position == want.position, f"step {step}"
        assert list(got.tokens) == want.tokens.tolist(), f"step {step}"


def request(batch_id: int, *updates, releases=()) -> pb.DraftRequest:
    msg = pb.DraftRequest(batch_id=batch_id, releases=releases)
    for u in updates:
        msg.updates.append(u if isinstance(u, pb.SequenceUpdate) else encode_update(u))
    return msg


def results_by_seq(response: pb.DraftResponse) -> dict[int, pb.SequenceResult]:
    return {getattr(r, r.WhichOneof("outcome")).seq_id: r for r in response.results}


# ------------------------------------------------------------------ bad input, table


def _upd(seq_id: int, start: int = 0, n: int = 2, tokens=None, hidden=None) -> pb.SequenceUpdate:
    tokens = tuple(i % (V - 1) + 1 for i in range(n)) if tokens is None else tokens
    hidden = torch.randn(len(tokens), H) if hidden is None else hidden
    return encode_update(SeqUpdate(seq_id, start, tokens, hidden)) if len(tokens) \
        else pb.SequenceUpdate(seq_id=seq_id, start=start, want_drafts=True)


def _mutate(msg: pb.SequenceUpdate, fn) -> pb.SequenceUpdate:
    fn(msg)
    msg.want_drafts = True
    return msg


def _nan_hidden(seq_id):
    h = torch.randn(2, H)
    h[1, 5] = float("nan")
    return _upd(seq_id, hidden=h)


@dataclass(frozen=True)
class Case:
    name: str
    bad: object  # seq_id -> pb.SequenceUpdate
    code: int
    text: str
    prepare: object = None  # seq_id -> a valid update sent one request earlier
    release: bool = False  # release the sequence in the bad update's request
    expected_start: int | None = None


CASES = [
    Case("hidden width", lambda s: _upd(s, hidden=torch.randn(2, H + 1)), ERR.Value(
        "ERROR_CODE_INVALID_ARGUMENT"), f"expected shape [n, {H}]"),
    Case("hidden byte length", lambda s: _mutate(_upd(s), lambda m: setattr(
        m.hidden, "data", m.hidden.data[:-4])), ERR.Value("ERROR_CODE_INVALID_ARGUMENT"),
        "bytes of data"),
    Case("unknown dtype", lambda s: _mutate(_upd(s), lambda m: setattr(m.hidden, "dtype", 77)),
         ERR.Value("ERROR_CODE_INVALID_ARGUMENT"), "unknown dtype 77"),
    Case("NaN hidden", _nan_hidden, ERR.Value("ERROR_CODE_INVALID_ARGUMENT"), "non-finite"),
    Case("token id >= vocab", lambda s: _upd(s, tokens=(3, V)),
         ERR.Value("ERROR_CODE_INVALID_ARGUMENT"), f"out of range for vocab size {V}"),
    Case("no token", lambda s: _upd(s, tokens=()), ERR.Value("ERROR_CODE_INVALID_ARGUMENT"),
         "at least 1 token"),
    Case("tokens vs rows", lambda s: _mutate(_upd(s, n=3), lambda m: m.tokens.append(4)),
         ERR.Value("ERROR_CODE_INVALID_ARGUMENT"), "4 tokens but 3 hidden rows"),
    Case("hidden missing", lambda s: _mutate(_upd(s), lambda m: m.ClearField("hidden")),
         ERR.Value("ERROR_CODE_INVALID_ARGUMENT"), "hidden: missing"),
    Case("top_k above max", lambda s: _mutate(_upd(s), lambda m: (
        setattr(m.sampling, "temperature", 1.0), setattr(m.sampling, "top_k", 50))),
        ERR.Value("ERROR_CODE_INVALID_ARGUMENT"), "top_k <= 4"),
    Case("unknown sequence", lambda s: _upd(s, start=9), ERR.Value(
        "ERROR_CODE_FAILED_PRECONDITION"), "unknown sequence", expected_start=0),
    Case("start out of sync", lambda s: _upd(s, start=7), ERR.Value(
        "ERROR_CODE_FAILED_PRECONDITION"), "expected start 4", prepare=lambda s: _upd(s, n=4),
        expected_start=4),
    Case("continue after release", lambda s: _upd(s, start=4), ERR.Value(
        "ERROR_CODE_FAILED_PRECONDITION"), "unknown sequence", prepare=lambda s: _upd(s, n=4),
        release=True, expected_start=0),
    Case("past max_len", lambda s: _upd(s, n=MAX_LEN - K + 1), ERR.Value(
        "ERROR_CODE_RESOURCE_EXHAUSTED"), f"max_len {MAX_LEN}"),
]


def _check_failure(case: Case, result: pb.SequenceResult) -> None:
    assert result.WhichOneof("outcome") == "error", case.name
    err = result.error
    assert err.code == case.code, (case.name, err)
    assert case.text in err.message, (case.name, err.message)
    if case.expected_start is None:
        assert not err.HasField("expected_start")
    else:
        assert err.HasField("expected_start") and err.expected_start == case.expected_start


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_update_fails_alone(server, pair, case: Case) -> None:
    good = Good.make(pair[1], rounds=2)
    stream = DraftStream(server.address)
    try:
        bad_id = 7
        first = [good.updates[0]] + ([case.prepare(bad_id)] if case.prepare else [])
        r = stream.ask(request(1, *first))
        good.check(0, r)
        r = stream.ask(request(2, good.updates[1], case.bad(bad_id),
                               releases=[bad_id] if case.release else []))
        assert r.batch_id == 2 and len(r.results) == 2
        _check_failure(case, results_by_seq(r)[bad_id])
        good.check(1, r)
        good.check(2, stream.ask(request(3, good.updates[2])))  # the stream is still up
    finally:
        stream.close()


def test_one_stream_survives_every_bad_input(server, pair) -> None:
    """All cases in one stream, one per request, while the good sequence keeps drafting."""
    good = Good.make(pair[1], rounds=2 * len(CASES) + 1, seed=3)
    stream = DraftStream(server.address, max_seqs=8)  # sequences of earlier cases linger
    try:
        good.check(0, stream.ask(request(0, good.updates[0])))
        step = 1
        for i, case in enumerate(CASES):
            bad_id = 100 + i
            if case.prepare:
                good.check(step, stream.ask(request(step, good.updates[step],
                                                    case.prepare(bad_id))))
                step += 1
            r = stream.ask(request(step, good.updates[step], case.bad(bad_id),
                                   releases=[bad_id] if case.release else []))
            _check_failure(case, results_by_seq(r)[bad_id])
            good.check(step, r)
            step += 1
    finally:
        stream.close()


def test_sampled_drafts_match_in_process_engine(server, pair) -> None:
    good = Good.make(pair[1], rounds=4, seed=5, sampled=True)
    stream = DraftStream(server.address)
    try:
        for step, u in enumerate(good.updates):
            (got,) = stream.ask(request(step, u)).results
            want = good.expected[step]
            assert list(got.drafts.tokens) == want.tokens.tolist()
            assert got.drafts.HasField("support") and got.drafts.HasField("probs")
    finally:
        stream.close()


def test_the_depth_asked_over_the_wire_is_the_depth_answered(server, pair) -> None:
    """Drafter-side depth over gRPC: an update's num_drafts reaches the served engine,
    which answers with that many drafts, equal to an in-process engine's under the same
    asks (sampled, so support and probs are cut to the depth too)."""
    updates = script(GOOD, 6, seed=9, sampled=True)
    asks = [0, 1, 2, 1, 1, K, 1]  # 0: K (the prompt)
    updates = [SeqUpdate(u.seq_id, u.start, u.tokens, u.hidden, sampling=u.sampling,
                         num_drafts=a) for u, a in zip(updates, asks, strict=True)]
    ref = drafter_engine(copy.deepcopy(pair[1]), k=K, max_len=MAX_LEN)
    stream = DraftStream(server.address)
    try:
        for step, u in enumerate(updates):
            (got,) = stream.ask(request(step, u)).results
            (want,) = ref.update([u])
            assert len(got.drafts.tokens) == (asks[step] or K), f"step {step}"
            assert list(got.drafts.tokens) == want.tokens.tolist(), f"step {step}"
            assert list(got.drafts.support.shape) == [asks[step] or K, 4]
    finally:
        stream.close()


# ------------------------------------------------------------------ stream rules


def test_every_request_answered_once_in_order(server, pair) -> None:
    """Empty requests, releases only, and prefill chunks without drafts still get exactly
    one response each, with their batch_id; only updates asking for drafts get entries."""
    stream = DraftStream(server.address)
    try:
        u = script(5, 1, seed=1)[0]
        chunk = SeqUpdate(5, 0, u.tokens[:3], u.hidden[:3], want_drafts=False)
        rest = SeqUpdate(5, 3, u.tokens[3:], u.hidden[3:])
        answers = [stream.ask(m) for m in (
            pb.DraftRequest(batch_id=11), request(12, chunk), request(13, rest),
            pb.DraftRequest(batch_id=14, releases=[5, 99]))]
        assert [a.batch_id for a in answers] == [11, 12, 13, 14]
        assert [len(a.results) for a in answers] == [0, 0, 1, 0]
        assert answers[2].results[0].drafts.position == len(u.tokens)
    finally:
        stream.close()


def test_seq_ids_are_scoped_per_stream(server, pair) -> None:
    a, b = Good.make(pair[1], rounds=2, seed=7), Good.make(pair[1], rounds=2, seed=8)
    sa, sb = DraftStream(server.address), DraftStream(server.address)
    engine = server.engine
    try:
        for step in range(3):  # the same seq_id in two streams: independent sequences
            a.check(step, sa.ask(request(step, a.updates[step])))
            b.check(step, sb.ask(request(step, b.updates[step])))
        assert engine.load == 2
        sa.close()
        assert wait_until(lambda: engine.load == 1), "a closed stream frees its sequences"
        r = sb.ask(request(9, encode_update(script(GOOD, 0, 9)[0]), releases=[GOOD]))
        assert r.results[0].drafts.position == 6  # release, then restart in one request
    finally:
        sb.close()
    assert wait_until(lambda: engine.load == 0)


def test_oversize_message_ends_stream_with_resource_exhausted(server, pair) -> None:
    stream = DraftStream(server.address)
    good = Good.make(pair[1], rounds=0)
    good.check(0, stream.ask(request(0, good.updates[0])))
    rows = MAX_BYTES // (4 * H) + 8
    big = SeqUpdate(2, 0, (1,) * rows, torch.randn(rows, H))
    with pytest.raises(grpc.RpcError) as err:
        stream.ask(encode_draft_request(UpdateBatch(1, (big,))))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stream.close()
    assert wait_until(lambda: server.engine.load == 0), "the dead stream's state is freed"
    fresh = DraftStream(server.address)  # the server itself is fine
    try:
        good.check(0, fresh.ask(request(0, good.updates[0])))
    finally:
        fresh.close()


def test_full_drafter_answers_resource_exhausted_per_sequence(loop, pair) -> None:
    running = start_drafter(loop, drafter_engine(pair[1], k=K, max_seqs=2))
    stream = DraftStream(running.address, max_seqs=3)  # the drafter is full, not the stream
    try:
        r = stream.ask(request(1, *(script(s, 0, s)[0] for s in (1, 2, 3))))
        kinds = {s: r.WhichOneof("outcome") for s, r in results_by_seq(r).items()}
        assert kinds == {1: "drafts", 2: "drafts", 3: "error"}
        assert results_by_seq(r)[3].error.code == ERR.Value("ERROR_CODE_RESOURCE_EXHAUSTED")
        r = stream.ask(request(2, script(3, 0, 3)[0], releases=[1]))
        assert r.results[0].WhichOneof("outcome") == "drafts"
    finally:
        stream.close()
        loop.run(running.stop(0))


# ------------------------------------------------------------------ health, drain, info


def _health(channel, service: str = ""):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5,
                      wait_for_ready=True).status


class _GatedEngine:
    """A drafter engine whose rounds wait for `gate`: holds serve_drafter in warm-up."""

    def __init__(self, engine) -> None:
        self.engine, self.gate = engine, threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def update(self, updates):
        assert self.gate.wait(20)
        return self.engine.update(updates)


def test_client_is_busy_while_a_batch_is_unanswered(loop, pair) -> None:
    """Adaptive depth takes no plain sample while the drafter works (engine/adaptive_depth
    `drafter_busy`): the client says so from sending a batch until its answer is in."""
    engine = _GatedEngine(drafter_engine(pair[1], k=K))
    engine.gate.set()  # warm-up passes
    running = start_drafter(loop, engine)
    client = GrpcDraftClient([running.address], round_deadline_s=10.0)
    try:
        assert client.wait_connected(20)
        assert not client.busy()
        engine.gate.clear()  # the drafter holds the next round
        client.submit(script(1, 0, seed=3)[:1])
        assert client.busy()
        engine.gate.set()
        assert 1 in client.collect()
        assert not client.busy()
        engine.gate.clear()  # the next round waits too, past the horizon: a hung drafter
        client.submit(script(1, 1, seed=3)[1:2])
        assert client.busy()
        for link in client._open:
            link.outstanding = {b: (sent - BUSY_HORIZON_S - 1, wanted)
                                for b, (sent, wanted) in link.outstanding.items()}
        assert not client.busy()
    finally:
        engine.gate.set()
        client.close()
        loop.run(running.stop(0))


def test_health_not_serving_until_warmed_up(loop, pair) -> None:
    engine = _GatedEngine(drafter_engine(pair[1], k=K))
    port = free_port()
    starting = loop.submit(serve_drafter(engine, ServerOptions(port=port), "tiny"))
    channel = make_channel(f"127.0.0.1:{port}")
    try:
        for name in ("", DRAFTER_SERVICE):
            assert _health(channel, name) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not starting.done()
        engine.gate.set()
        running = starting.result(20)
        for name in ("", DRAFTER_SERVICE):
            assert _health(channel, name) == health_pb2.HealthCheckResponse.SERVING
        assert engine.load == 0, "the warm-up sequence is released"
        loop.run(running.stop(0))
    finally:
        engine.gate.set()
        channel.close()


def test_drain(loop, pair) -> None:
    """NOT_SERVING while draining; new streams and calls UNAVAILABLE; an open stream's
    updates UNAVAILABLE per sequence; done as soon as the last stream closes."""
    engine = drafter_engine(pair[1], k=K)
    running = start_drafter(loop, engine, drain_grace_s=30)
    channel = make_channel(running.address)
    stream = DraftStream(running.address)
    good = Good.make(pair[1], rounds=1)
    good.check(0, stream.ask(request(0, good.updates[0])))
    draining = loop.submit(running.drain())
    assert wait_until(lambda: _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING)
    assert _health(channel, DRAFTER_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.DrafterStub(channel).Info(pb.DrafterInfoRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    late = DraftStream(running.address)
    with pytest.raises(grpc.RpcError) as err:
        late.ask(request(0, good.updates[0]))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    (r,) = stream.ask(request(1, good.updates[1])).results
    assert r.error.code == ERR.Value("ERROR_CODE_UNAVAILABLE") and "draining" in r.error.message
    assert engine.load == 0, "a draining drafter lets go of the sequences it refuses"
    time.sleep(0.2)
    assert not draining.done(), "drain waits for the open stream"
    t0 = time.monotonic()
    stream.close()
    draining.result(10)
    assert time.monotonic() - t0 < 5, "drain ends when the last stream does, not at grace"
    channel.close()


def test_drain_cancels_streams_left_open_after_grace(loop, pair) -> None:
    running = start_drafter(loop, drafter_engine(pair[1], k=K), drain_grace_s=0.3)
    stream = DraftStream(running.address)
    stream.ask(pb.DraftRequest(batch_id=1))
    t0 = time.monotonic()
    loop.run(running.drain())
    assert 0.25 < time.monotonic() - t0 < 5
    with pytest.raises(grpc.RpcError):
        stream.ask(pb.DraftRequest(batch_id=2))
    stream.channel.close()


def test_reflection_lists_services(server) -> None:
    channel = make_channel(server.address)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=DRAFTER_SERVICE)]
    listed, found = stub.ServerReflectionInfo(iter(reqs), timeout=5)
    names = {s.name for s in listed.list_services_response.service}
    assert {DRAFTER_SERVICE, "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in found.file_descriptor_response.file_descriptor_proto]
    assert "chainspec/v1/drafter.proto" in {f.name for f in files}
    channel.close()


def test_info(server, pair) -> None:
    target, draft = pair
    channel = make_channel(server.address)
    stream = DraftStream(server.address)
    try:
        stream.ask(request(1, *(script(s, 0, s)[0] for s in (1, 2))))
        info = pb_grpc.DrafterStub(channel).Info(pb.DrafterInfoRequest(), timeout=5)
    finally:
        stream.close()
        channel.close()
    assert (info.model_name, info.num_draft_tokens, info.num_mtp_modules, info.hidden_size,
            info.vocab_size, info.dtype, info.chain, info.capacity, info.load,
            info.max_top_k, info.max_message_bytes) == \
        ("tiny", K, 2, H, V, "float32", True, 8, 2, 4, MAX_BYTES)
    assert info.version
    # embedding and head are what verifier and drafter share: the fingerprints pair up
    assert info.weights_fingerprint == model_fingerprint(target) == model_fingerprint(draft)
    assert info.weights_fingerprint != model_fingerprint(tied_pair(seed=4)[0])

"""Edges of the gRPC surface that a hostile or broken client reaches: bytes that do not
decode, hidden states of the wrong dtype, error messages in the client's ids, Abort by
someone else, one Draft stream taking the whole drafter, and a huge prompt stalling the
verifier's event loop."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError

from chainspec.engine.draft_types import SeqUpdate
from chainspec.engine.request import FinishReason, RequestOutput
from chainspec.models.loader import load_draft_model
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.codec import encode_tensor
from chainspec.rpc.draft_codec import MAX_SEQS_KEY, encode_update
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.generate_codec import GenerateLimits
from chainspec.rpc.generated.v1 import drafter_pb2 as dpb
from chainspec.rpc.generated.v1 import verifier_pb2 as vpb
from chainspec.rpc.generated.v1 import verifier_pb2_grpc as vpb_grpc
from chainspec.rpc.server import ServerOptions, start_server
from chainspec.rpc.verifier_service import (
    ABORT_KEY,
    VERIFIER_SERVICE,
    VerifierOptions,
    VerifierServicer,
    serve_verifier,
)
from tests.integration.grpc_helpers import DraftStream, drafter_engine, wait_until
from tests.integration.helpers import generate, verifier_stub
from tests.integration.test_drafter_service import request as draft_request
from tests.integration.test_drafter_service import results_by_seq, script
from tests.integration.test_verifier_service import K, local_opts
from tests.unit.engine_fixtures import tied_pair

pytestmark = pytest.mark.timeout(120)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
ERR = dpb.ErrorCode
PER_METHOD = 200  # undecodable payloads sent to each method


@pytest.fixture(scope="module")
def services(model_dir, loop_thread):
    """A drafter (capacity 16) and a verifier routed to it."""
    engine = drafter_engine(load_draft_model(model_dir, cache_len=256), k=K, max_seqs=16)
    drafter = loop_thread.run(serve_drafter(engine, ServerOptions(), "tiny"))
    verifier = loop_thread.run(serve_verifier(VerifierOptions(local_opts(model_dir)),
                                              ServerOptions(), [drafter.address]))
    yield SimpleNamespace(verifier=verifier, drafter=drafter, drafter_engine=engine)
    loop_thread.run(verifier.stop())
    loop_thread.run(drafter.stop())


# ------------------------------------------------------------------ undecodable bytes


def _undecodable(message_type, valid: bytes, seed: int) -> list[bytes]:
    """PER_METHOD payloads that `message_type` cannot parse: truncated and bit-flipped
    valid messages first, then random bytes."""
    rng = random.Random(seed)
    candidates = [valid[:i] for i in range(1, len(valid))]
    for _ in range(200):
        flipped = bytearray(valid)
        if flipped:
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        candidates.append(bytes(flipped))
    candidates += [rng.randbytes(rng.randint(1, 80)) for _ in range(2000)]
    out = []
    for payload in dict.fromkeys(candidates):
        try:
            message_type.FromString(payload)
        except DecodeError:
            out.append(payload)
    assert len(out) >= PER_METHOD
    return out[:PER_METHOD]


def _draft_message() -> bytes:
    u = SeqUpdate(3, 0, (1, 2, 3), torch.randn(3, 32))
    return dpb.DraftRequest(batch_id=7, updates=[encode_update(u)],
                            releases=[1]).SerializeToString()


METHODS = [  # (method, request type, a valid request, kind)
    ("/chainspec.v1.Verifier/Generate", vpb.GenerateRequest, vpb.GenerateRequest(
        request_id="r", text="hello world", sampling=vpb.SamplingParams(temperature=0.5),
        stop=vpb.StopConditions(max_tokens=1, stop=["x"])).SerializeToString(), "stream"),
    ("/chainspec.v1.Verifier/Abort", vpb.AbortRequest,
     vpb.AbortRequest(request_id="some-request").SerializeToString(), "unary"),
    ("/chainspec.v1.Verifier/Info", vpb.VerifierInfoRequest, b"", "unary"),
    ("/chainspec.v1.Drafter/Draft", dpb.DraftRequest, _draft_message(), "bidi"),
    ("/chainspec.v1.Drafter/Info", dpb.DrafterInfoRequest, b"", "unary"),
]


def _raw_call(channel: grpc.Channel, method: str, kind: str, payload: bytes) -> grpc.StatusCode:
    """The status of one call carrying `payload` as its (only) request message."""
    try:
        if kind == "unary":
            channel.unary_unary(method)(payload, timeout=10)
        elif kind == "stream":
            for _ in channel.unary_stream(method)(payload, timeout=10):
                pass
        else:
            for _ in channel.stream_stream(method)(iter([payload]), timeout=10):
                pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method, message_type, valid, kind", METHODS,
                         ids=[m[0].rsplit(".", 1)[1] for m in METHODS])
def test_undecodable_request_is_invalid_argument(services, method, message_type, valid,
                                                 kind) -> None:
    """Never UNKNOWN (grpc's answer to a deserializer that raises) or INTERNAL."""
    target = services.drafter if "Drafter" in method else services.verifier
    channel = grpc.insecure_channel(target.address)
    try:
        codes = [_raw_call(channel, method, kind, p)
                 for p in _undecodable(message_type, valid, seed=len(method))]
    finally:
        channel.close()
    wrong = {code.name: codes.count(code) for code in set(codes) if code != INVALID}
    assert not wrong, f"{method}: {wrong} of {len(codes)} undecodable requests"


def test_undecodable_message_mid_stream_ends_the_draft_stream(services) -> None:
    """A garbage message after good ones: INVALID_ARGUMENT, and the stream's sequences
    are released."""
    engine = services.drafter_engine
    channel = grpc.insecure_channel(services.drafter.address)
    sent = threading.Event()

    def messages():
        yield _draft_message()
        sent.wait(10)
        yield _draft_message()[:-5]  # truncated inside the hidden data

    calls = channel.stream_stream("/chainspec.v1.Drafter/Draft")(messages(), timeout=10)
    try:
        first = dpb.DraftResponse.FromString(next(calls))
        assert first.results[0].WhichOneof("outcome") == "drafts"
        assert engine.load == 1
        sent.set()
        with pytest.raises(grpc.RpcError) as err:
            next(calls)
        assert err.value.code() == INVALID and "does not decode" in err.value.details()
        assert wait_until(lambda: engine.load == 0), "the broken stream's state is freed"
    finally:
        channel.close()


# ------------------------------------------------------------------ drafter edges

H, V = 32, 61  # tied_pair's model


@pytest.fixture(scope="module")
def drafter16(loop_thread):
    """A drafter over the tied pair, capacity 16: an undeclared stream may hold 4."""
    engine = drafter_engine(tied_pair()[1], k=K, max_seqs=16)
    running = loop_thread.run(serve_drafter(engine, ServerOptions(), "tiny"))
    running.engine = engine
    yield running
    loop_thread.run(running.stop(0))


def test_int32_hidden_states_are_invalid_argument(drafter16) -> None:
    stream = DraftStream(drafter16.address)
    try:
        good, bad = script(1, 0, 1)[0], encode_update(script(2, 0, 2)[0])
        bad.hidden.CopyFrom(encode_tensor(torch.ones(len(bad.tokens), H, dtype=torch.int32)))
        got = results_by_seq(stream.ask(draft_request(1, good, bad)))
        assert got[1].WhichOneof("outcome") == "drafts"
        err = got[2].error
        assert err.code == ERR.Value("ERROR_CODE_INVALID_ARGUMENT")
        assert "updates[1].hidden: dtype INT32 is not allowed" in err.message
    finally:
        stream.close()


def _named_ids(message: str) -> set[int]:
    return {int(n) for n in re.findall(r"sequence (\d+)", message)}


def test_errors_name_the_clients_seq_ids(drafter16) -> None:
    """Engine ids are per drafter; a verifier only knows its own ids."""
    busy = DraftStream(drafter16.address, max_seqs=4)  # moves the engine's id counter on
    stream = DraftStream(drafter16.address, max_seqs=1)
    try:
        busy.ask(draft_request(1, *(script(s, 0, s)[0] for s in (40, 41, 42))))
        stream.ask(draft_request(1, script(5, 0, 5)[0]))  # seq 5: 6 rows
        got = results_by_seq(stream.ask(draft_request(2, SeqUpdate(5, 9, (1,), torch.ones(1, H)),
                                                      SeqUpdate(6, 9, (1,), torch.ones(1, H)),
                                                      script(7, 0, 7)[0])))
        out_of_sync, unknown, over_limit = got[5].error, got[6].error, got[7].error
        assert "expected start 6" in out_of_sync.message
        assert "unknown sequence" in unknown.message
        for seq_id, err in ((5, out_of_sync), (6, unknown), (7, over_limit)):
            assert err.seq_id == seq_id and _named_ids(err.message) == {seq_id}, err.message
        assert over_limit.code == ERR.Value("ERROR_CODE_RESOURCE_EXHAUSTED")
    finally:
        stream.close()
        busy.close()


def _kinds(response: dpb.DraftResponse) -> dict[int, str]:
    return {s: r.WhichOneof("outcome") for s, r in results_by_seq(response).items()}


def test_a_stream_holds_only_what_it_declared(drafter16) -> None:
    """Declared 2: the third and fourth new sequences are refused per sequence; a release
    makes room; a resync (start 0 of a held sequence) is no new sequence."""
    stream = DraftStream(drafter16.address, max_seqs=2)
    try:
        r = stream.ask(draft_request(1, *(script(s, 0, s)[0] for s in (1, 2, 3, 4))))
        assert _kinds(r) == {1: "drafts", 2: "drafts", 3: "error", 4: "error"}
        err = results_by_seq(r)[3].error
        assert err.code == ERR.Value("ERROR_CODE_RESOURCE_EXHAUSTED")
        assert MAX_SEQS_KEY in err.message and _named_ids(err.message) == {3}
        assert drafter16.engine.load == 2
        r = stream.ask(draft_request(2, script(1, 0, 9)[0], script(3, 0, 3)[0], releases=[2]))
        assert _kinds(r) == {1: "drafts", 3: "drafts"}
    finally:
        stream.close()
    assert wait_until(lambda: drafter16.engine.load == 0)


def test_a_rogue_stream_cannot_take_the_drafter(drafter16) -> None:
    """An undeclared stream asking for every slot gets a quarter of them; a verifier's
    stream opened afterwards still gets drafts for all it declared."""
    rogue = DraftStream(drafter16.address)
    verifier = DraftStream(drafter16.address, max_seqs=8)
    try:
        r = rogue.ask(draft_request(1, *(script(s, 0, s)[0] for s in range(16))))
        kinds = _kinds(r)
        assert sorted(kinds.values()).count("drafts") == 4
        assert all(results_by_seq(r)[s].error.code == ERR.Value("ERROR_CODE_RESOURCE_EXHAUSTED")
                   for s, kind in kinds.items() if kind == "error")
        r = verifier.ask(draft_request(1, *(script(s, 0, s)[0] for s in range(8))))
        assert set(_kinds(r).values()) == {"drafts"} and len(r.results) == 8
    finally:
        rogue.close()
        verifier.close()
    assert wait_until(lambda: drafter16.engine.load == 0)


@pytest.mark.parametrize("value", ["0", "-3", "many", "9" * 20])
def test_a_bad_declaration_is_invalid_argument(drafter16, value) -> None:
    channel = grpc.insecure_channel(drafter16.address)
    try:
        draft = channel.stream_stream("/chainspec.v1.Drafter/Draft")
        with pytest.raises(grpc.RpcError) as err:
            list(draft(iter([b""]), metadata=((MAX_SEQS_KEY, value),), timeout=10))
        assert err.value.code() == INVALID and MAX_SEQS_KEY in err.value.details()
    finally:
        channel.close()


# ------------------------------------------------------------------ Generate and Abort


def _long_call(stub, request_id: str):
    call = stub.Generate(vpb.GenerateRequest(
        request_id=request_id, tokens=vpb.PromptTokens(ids=[5, 6, 7]),
        stop=vpb.StopConditions(max_tokens=200, ignore_eos=True)), timeout=60)
    next(call)  # running
    return call


def _other_client(address: str) -> tuple[grpc.Channel, vpb_grpc.VerifierStub]:
    """A client on its own connection (channels of one process share one by default)."""
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, vpb_grpc.VerifierStub(channel)


def test_abort_only_by_the_owner(services) -> None:
    """Another connection can abort neither by id nor with a wrong key (answered as not
    found); the owner can on its own connection, and anywhere with its abort key."""
    channel, stub = verifier_stub(services.verifier.address)
    other, stranger = _other_client(services.verifier.address)
    try:
        first, second = _long_call(stub, "owned-1"), _long_call(stub, "owned-2")
        assert not stranger.Abort(vpb.AbortRequest(request_id="owned-1")).found
        assert not stranger.Abort(vpb.AbortRequest(request_id="owned-1", abort_key="x" * 22)).found
        key = dict(second.initial_metadata())[ABORT_KEY]
        assert not stranger.Abort(vpb.AbortRequest(request_id="owned-1", abort_key=key)).found
        assert next(first).HasField("chunk"), "still running"
        assert stub.Abort(vpb.AbortRequest(request_id="owned-1")).found  # same connection
        assert stranger.Abort(vpb.AbortRequest(request_id="owned-2", abort_key=key)).found
        for call in (first, second):
            assert list(call)[-1].finished.reason == vpb.FINISH_REASON_ABORT
        assert not stub.Abort(vpb.AbortRequest(request_id="owned-1")).found
    finally:
        other.close()
        channel.close()


def test_duplicate_request_id_names_the_clients_id(services) -> None:
    channel, stub = verifier_stub(services.verifier.address)
    try:
        call = _long_call(stub, "dup-id")
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, [5], request_id="dup-id")
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert err.value.details() == "request_id: 'dup-id' is already in use"
        call.cancel()
    finally:
        channel.close()


# ------------------------------------------------------------------ long prompts


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def _heartbeat(stop: threading.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def _while_running(loop_thread, work, probes) -> tuple[float, float, list[float]]:
    """Runs `work` on a thread; meanwhile each probe over and over. Returns the work's
    duration, the longest stall of the servers' event loop, and each probe's slowest call.

    NOTE: the probes share the process (and the GIL) with the servers, so they are blind
    while something holds the GIL; the heartbeat on the servers' loop is not.
    """
    slowest = [0.0] * len(probes)
    done, gaps = threading.Event(), []
    beating = asyncio.run_coroutine_threadsafe(_heartbeat(done, gaps), loop_thread.loop)
    thread = threading.Thread(target=lambda: (work(), done.set()), daemon=True)
    t0 = time.perf_counter()
    thread.start()
    time.sleep(0.1)  # the big request is on its way
    while True:  # at least once
        for i, probe in enumerate(probes):
            slowest[i] = max(slowest[i], _timed(probe))
        if done.is_set():
            break
    thread.join(60)
    took = time.perf_counter() - t0
    beating.result(10)
    return took, max(gaps), slowest


def test_a_10mb_prompt_is_refused_without_stalling_anyone(services, loop_thread) -> None:
    channel, stub = verifier_stub(services.verifier.address)
    errors = []

    def huge():
        try:
            generate(stub, "hello world " * 850_000)
        except grpc.RpcError as e:
            errors.append(e)
    try:
        took, stall, (info_s, short_s) = _while_running(loop_thread, huge, [
            lambda: stub.Info(vpb.VerifierInfoRequest(), timeout=10),
            lambda: generate(stub, "hello", max_tokens=2)])
    finally:
        channel.close()
    assert stall < 0.5 and info_s < 1.0 and short_s < 1.0, (took, stall, info_s, short_s)
    assert took < 2.0, "refused before tokenizing"
    (err,) = errors
    assert err.code() == INVALID and err.details().startswith("prompt.text: 10200000 char")


class _EchoEngine:
    """Just enough of AsyncVerifier: one token per request; records the prompts."""

    running = waiting = 0
    engine = SimpleNamespace(config=SimpleNamespace(max_seqs=4))

    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}

    async def generate(self, rid, prompt, sampling, stop, admission=None,
                       num_speculative_tokens=None, generated=(), cache_salt=""):
        self.prompts[rid] = list(prompt)
        yield RequestOutput(rid, (1,), FinishReason.LENGTH)

    async def abort(self, rid) -> bool:
        return False


def test_tokenizing_a_long_prompt_leaves_the_loop_free(model_dir, loop_thread) -> None:
    """A prompt within bounds that takes seconds to tokenize (a long context) is
    tokenized on a worker thread, into the same ids as the tokenizer's `encode`."""
    tokenizer, engine = Tokenizer.from_dir(model_dir), _EchoEngine()
    servicer = VerifierServicer(engine, GenerateLimits(300, 4_000_000, K), tokenizer, "tiny")
    running = loop_thread.run(start_server(ServerOptions(), servicer.register,
                                           [VERIFIER_SERVICE]))
    channel, stub = verifier_stub(running.address)
    text = "the quick brown fox, " * 100_000  # 2.1 MB: about 1.5 s of tokenizing
    try:
        took, stall, (info_s, short_s) = _while_running(
            loop_thread, lambda: generate(stub, text, request_id="big"), [
                lambda: stub.Info(vpb.VerifierInfoRequest(), timeout=10),
                lambda: generate(stub, "hello", max_tokens=2)])
        assert took > 1.0, "the prompt was meant to take a while"
        assert stall < 0.5 and info_s < 1.0 and short_s < 1.0, (took, stall, info_s, short_s)
        assert engine.prompts["big"] == tokenizer.encode(text)
    finally:
        channel.close()
        loop_thread.run(running.stop(0))
        servicer.close()

"""The Verifier service over real gRPC on loopback, with a real Drafter service, in one
process (no Ray): lossless outputs, streaming text, stops, bad input, cancel, abort,
queue full, drain."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import LocalOptions
from chainspec.models.loader import load_draft_model
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier
from tests.integration.helpers import generate, plain_outputs, prompt_ids, verifier_stub

K = 3


def local_opts(model_dir, max_seqs: int = 8) -> LocalOptions:
    return LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=max_seqs, max_len=256)


@pytest.fixture(scope="module")
def services(model_dir, loop_thread):
    """A drafter and a verifier routed to it; yields (verifier, drafter engine, stub)."""
    engine = DrafterEngine(load_draft_model(model_dir, cache_len=256),
                           DrafterConfig(num_steps=K, max_seqs=16, max_len=256))
    drafter = loop_thread.run(serve_drafter(engine, ServerOptions(), "tiny"))
    verifier = loop_thread.run(serve_verifier(VerifierOptions(local_opts(model_dir)),
                                              ServerOptions(), [drafter.address]))
    channel, stub = verifier_stub(verifier.address)
    yield verifier, engine, stub
    channel.close()
    loop_thread.run(verifier.stop())
    loop_thread.run(drafter.stop())


@pytest.fixture(scope="module")
def plain(model_dir):
    return plain_outputs(model_dir, prompt_ids(model_dir))


def concurrently(fn, args_list):
    results = [None] * len(args_list)

    def work(i, args):
        results[i] = fn(*args)
    threads = [threading.Thread(target=work, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_equals_plain_decoding(services, model_dir, plain, batch) -> None:
    _, _, stub = services
    ps = prompt_ids(model_dir)
    got = []
    for i in range(0, len(ps), batch):
        got += concurrently(lambda p: generate(stub, p), [(p,) for p in ps[i:i + batch]])
    assert [g.tokens for g in got] == plain
    stats = [g.finished.stats for g in got]
    assert all(g.finished.reason == pb.FINISH_REASON_LENGTH for g in got)
    assert sum(s.accepted_tokens for s in stats) > 0  # speculation over gRPC worked
    assert all(len(s.accepted_per_position) == K and s.completion_tokens == 24 for s in stats)


def test_text_prompt_streams_text_deltas(services, model_dir, plain) -> None:
    _, _, stub = services
    tok = Tokenizer.from_dir(model_dir)
    got = generate(stub, "hello world")
    assert got.tokens == plain[1]
    assert got.text == tok.decode(got.tokens)
    assert got.finished.stats.prompt_tokens == len(tok.encode("hello world"))


def test_stop_string_and_stop_token(services, model_dir, plain) -> None:
    _, _, stub = services
    tok = Tokenizer.from_dir(model_dir)
    full = tok.decode(plain[1])
    assert "Zbo" in full  # the tiny model's output for this prompt
    got = generate(stub, "hello world", stop=pb.StopConditions(max_tokens=24, stop=["Zbo"],
                                                               ignore_eos=True))
    assert got.finished.reason == pb.FINISH_REASON_STOP
    assert got.text == full[:full.index("Zbo")]
    stop_id = plain[0][4]
    got = generate(stub, prompt_ids(model_dir)[0],
                   stop=pb.StopConditions(max_tokens=24, stop_token_ids=[stop_id],
                                          ignore_eos=True))
    assert got.tokens == plain[0][:plain[0].index(stop_id) + 1]
    assert got.finished.reason == pb.FINISH_REASON_STOP


def _tokens(ids):
    return {"tokens": pb.PromptTokens(ids=ids)}


BAD = [
    ("no prompt", {}, "prompt"),
    ("empty token prompt", _tokens([]), "prompt.tokens.ids"),
    ("empty text prompt", {"text": ""}, "prompt.text"),
    ("token id >= vocab", _tokens([1, 100_000]), "prompt.tokens.ids[1]"),
    ("prompt longer than the context", _tokens([1] * 300), "prompt.tokens"),
    ("negative temperature", {**_tokens([1]), "sampling": pb.SamplingParams(temperature=-1)},
     "sampling.temperature"),
    ("NaN temperature", {**_tokens([1]), "sampling": pb.SamplingParams(temperature=float("nan"))},
     "sampling.temperature"),
    ("top_p > 1", {**_tokens([1]), "sampling": pb.SamplingParams(top_p=1.5)}, "sampling.top_p"),
    ("top_p < 0", {**_tokens([1]), "sampling": pb.SamplingParams(top_p=-0.1)}, "sampling.top_p"),
    ("empty stop string", {**_tokens([1]), "stop": pb.StopConditions(stop=["ok", ""])},
     "stop.stop[1]"),
    ("stop token >= vocab", {**_tokens([1]), "stop": pb.StopConditions(stop_token_ids=[5000])},
     "stop.stop_token_ids[0]"),
]


def test_bad_input_is_invalid_argument_naming_the_field(services, plain, model_dir) -> None:
    _, _, stub = services
    long_run = []
    runner = threading.Thread(target=lambda: long_run.append(
        generate(stub, prompt_ids(model_dir)[0], max_tokens=24)))
    runner.start()  # a good request keeps going while the bad ones are refused
    for what, fields, field in BAD:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(**fields), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        assert err.value.details().startswith(field), (what, err.value.details())
    runner.join(timeout=60)
    assert long_run[0].tokens == plain[0]


def test_max_tokens_is_clamped_to_the_context(services) -> None:
    _, _, stub = services
    got = generate(stub, [1] * 240, max_tokens=100)  # context: 256 - 1 - K = 252
    assert len(got.tokens) == 252 - 240
    assert got.finished.reason == pb.FINISH_REASON_LENGTH


def test_client_cancel_frees_slot_and_drafter_state(services, model_dir) -> None:
    verifier, drafter_engine, stub = services
    call = stub.Generate(pb.GenerateRequest(tokens=pb.PromptTokens(ids=[5, 6, 7]),
                                            stop=pb.StopConditions(max_tokens=200,
                                                                   ignore_eos=True)))
    next(call)  # running
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (verifier.load or drafter_engine.load):
        time.sleep(0.05)
    assert verifier.load == 0 and drafter_engine.load == 0


def test_abort_ends_the_stream_with_abort(services) -> None:
    _, _, stub = services
    call = stub.Generate(pb.GenerateRequest(request_id="to-abort",
                                            tokens=pb.PromptTokens(ids=[5, 6, 7]),
                                            stop=pb.StopConditions(max_tokens=200,
                                                                   ignore_eos=True)))
    next(call)
    assert stub.Abort(pb.AbortRequest(request_id="to-abort")).found
    last = list(call)[-1]
    assert last.finished.reason == pb.FINISH_REASON_ABORT
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort")).found


def test_info(services, model_dir) -> None:
    _, _, stub = services
    info = stub.Info(pb.VerifierInfoRequest())
    assert (info.num_draft_tokens, info.capacity, info.drafters) == (K, 8, 1)
    assert info.max_model_len == 256 - 1 - K and info.weights_fingerprint


def test_queue_full_then_draining(model_dir, loop_thread) -> None:
    """One slot, no waiting room: a second request is RESOURCE_EXHAUSTED; once draining,
    new requests are UNAVAILABLE while the running one finishes."""
    opts = VerifierOptions(local_opts(model_dir, max_seqs=1), max_waiting=0)
    verifier = loop_thread.run(serve_verifier(opts, ServerOptions(drain_grace_s=30)))
    channel, stub = verifier_stub(verifier.address)
    try:
        call = stub.Generate(pb.GenerateRequest(tokens=pb.PromptTokens(ids=[5]),
                                                stop=pb.StopConditions(max_tokens=60,
                                                                       ignore_eos=True)))
        next(call)
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, [6])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "full" in err.value.details()
        drained = asyncio.run_coroutine_threadsafe(verifier.drain(), loop_thread.loop)
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, [6])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        last = list(call)[-1]  # the running request completes
        assert last.finished.reason == pb.FINISH_REASON_LENGTH
        drained.result(timeout=30)
    finally:
        channel.close()
        loop_thread.run(verifier.stop())


def test_context_never_passes_the_models_positions(model_dir, loop_thread) -> None:
    """Slots longer than the model's max_position_embeddings (512 here): Info reports the
    model's context, not the slots' (it said 1020 for the 512-position demo model), and a
    request asking for more is clamped there (finish LENGTH), every position < 512."""
    opts = VerifierOptions(LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=1,
                                        max_len=1024))
    verifier = loop_thread.run(serve_verifier(opts, ServerOptions()))
    channel, stub = verifier_stub(verifier.address)
    try:
        assert stub.Info(pb.VerifierInfoRequest()).max_model_len == 512 - 1 - K
        prompt = [5] * 400
        got = generate(stub, prompt, max_tokens=500)
        assert len(prompt) + len(got.tokens) == 512 - 1 - K
        assert got.finished.reason == pb.FINISH_REASON_LENGTH
    finally:
        channel.close()
        loop_thread.run(verifier.stop())

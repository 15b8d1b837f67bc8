"""Logits processing and logprobs through `Verifier.Generate` on loopback gRPC with a
local drafter: the stream carries the same tokens as an in-process plain engine with the
same processing, and one logprob entry per token (the greedy token is its row's top)."""

from __future__ import annotations

import pytest

from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier
from tests.integration.helpers import prompt_ids, verifier_stub

K, MAX_TOKENS = 3, 16


@pytest.fixture(scope="module")
def stub(model_dir, loop_thread):
    opts = LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=4, max_len=256)
    verifier = loop_thread.run(serve_verifier(VerifierOptions(opts, drafter="local"),
                                              ServerOptions()))
    channel, stub = verifier_stub(verifier.address)
    yield stub
    channel.close()
    loop_thread.run(verifier.stop())


def test_processing_and_logprobs_over_generate(model_dir, stub) -> None:
    prompts = prompt_ids(model_dir, 4)
    opts = LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=4, max_len=256)
    engine = build_verifier(load_models(opts, speculative=False), opts, speculative=False)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                            logit_bias={3: 2.0})
    stop = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = [c.tokens for c in run_to_completion(engine, prompts, params, stop).completions]
    for prompt, want in zip(prompts, plain, strict=True):
        req = pb.GenerateRequest(
            tokens=pb.PromptTokens(ids=prompt),
            sampling=pb.SamplingParams(temperature=0.0, repetition_penalty=1.5,
                                       frequency_penalty=0.5, logit_bias={3: 2.0}, logprobs=2),
            stop=pb.StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True))
        tokens, logprobs = [], []
        for msg in stub.Generate(req, timeout=60):
            if msg.HasField("chunk"):
                assert len(msg.chunk.logprobs) == len(msg.chunk.token_ids)
                tokens += msg.chunk.token_ids
                logprobs += msg.chunk.logprobs
        assert tokens == want
        assert [lp.token_id for lp in logprobs] == tokens
        assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token_id == lp.token_id
                   and lp.logprob <= 0 for lp in logprobs)

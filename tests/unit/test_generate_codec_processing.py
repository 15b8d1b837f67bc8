"""Generate's wire for logits processing and logprobs: every new SamplingParams field
reaches the engine's SamplingParams, out-of-range values are INVALID_ARGUMENT naming the
field, logprobs travel in TokenChunk, and include_stop_str_in_output keeps the stop
string in the text."""

from __future__ import annotations

import grpc
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from chainspec.engine.detokenizer import IncrementalDetokenizer
from chainspec.engine.logprobs import TokenLogprob
from chainspec.engine.request import FinishReason, RequestOutput
from chainspec.rpc.codec import WireError
from chainspec.rpc.generate_codec import GenerateLimits, chunk_message, parse_generate
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.verifier_service import _ResponseWriter

LIMITS = GenerateLimits(vocab_size=50, max_len=128, num_steps=3, default_max_tokens=16)


def request(**sampling) -> pb.GenerateRequest:
    stop = sampling.pop("stop", {})
    return pb.GenerateRequest(tokens=pb.PromptTokens(ids=[1, 2, 3]),
                              sampling=pb.SamplingParams(**sampling),
                              stop=pb.StopConditions(**stop))


def test_fields_reach_sampling_params() -> None:
    args = parse_generate(request(presence_penalty=0.5, frequency_penalty=-1.0,
                                  repetition_penalty=1.25, logit_bias={7: 3.0, 2: -100.0},
                                  min_p=0.25, min_tokens=4, logprobs=5,
                                  stop={"include_stop_str_in_output": True}), LIMITS, None)
    s = args.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.25)
    assert s.logit_bias == ((2, -100.0), (7, 3.0))
    assert (s.min_p, s.min_tokens, s.num_logprobs) == (0.25, 4, 5)
    assert args.include_stop_str


def test_unset_fields_are_off() -> None:
    args = parse_generate(request(temperature=0.5), LIMITS, None)
    assert args.sampling.repetition_penalty == 1.0 and args.sampling.num_logprobs is None
    assert not args.sampling.processes_logits and not args.include_stop_str
    assert parse_generate(request(logprobs=0), LIMITS, None).sampling.num_logprobs == 0


@pytest.mark.parametrize("fields,path", [
    ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
    ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "sampling.repetition_penalty"),
    ({"logit_bias": {50: 1.0}}, "sampling.logit_bias[50]"),
    ({"logit_bias": {3: 100.5}}, "sampling.logit_bias[3]"),
    ({"min_p": 1.5}, "sampling.min_p"),
    ({"logprobs": 21}, "sampling.logprobs"),
    ({"min_tokens": 17}, "sampling.min_tokens"),  # above the default max_tokens 16
    ({"min_tokens": 9, "stop": {"max_tokens": 8}}, "sampling.min_tokens"),
])
def test_bad_values_are_invalid_argument(fields, path) -> None:
    with pytest.raises(WireError) as e:
        parse_generate(request(**fields), LIMITS, None)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith(path + ":")


def test_logprobs_travel_in_token_chunks() -> None:
    lps = (TokenLogprob(4, -0.25, ((4, -0.25), (9, -2.0))), TokenLogprob(9, -1.5, ()))
    msg = pb.GenerateResponse.FromString(
        chunk_message("r", (4, 9), "ab", lps).SerializeToString())
    got = [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
           for lp in msg.chunk.logprobs]
    assert got == [(4, -0.25, [(4, -0.25), (9, -2.0)]), (9, -1.5, [])]
    assert not chunk_message("r", (4,), "a").chunk.logprobs


def _chars_backend() -> Backend:
    """Token id i is the character chr(97 + i)."""
    backend = Backend(models.BPE({chr(97 + i): i for i in range(26)}, []))
    backend.decoder = decoders.Fuse()
    return backend


class _Chars:
    """A tokenizer stand-in over `_chars_backend`."""

    max_token_chars = 1
    backend = _chars_backend()


@pytest.mark.parametrize("include,text", [(False, "ab"), (True, "abcd")])
def test_include_stop_str_in_output(include, text) -> None:
    writer = _ResponseWriter("r", (5, 6, 7), _Chars(), ("cd",), include)
    out = RequestOutput("r", (0, 1, 2, 3, 4), FinishReason.STOP, "cd")
    msgs = writer.messages(out)
    assert msgs[0].chunk.text == text
    detok = IncrementalDetokenizer(_Chars.backend, (), ("cd",))
    assert detok.add([0, 1, 2]) == "ab"  # "c" held back: it may start the stop string
    assert detok.finish([3, 4], "cd", include) == text[2:]


@pytest.mark.parametrize("include,text", [(False, "abc"), (True, "abcd")])
def test_a_stop_token_id_is_not_in_the_text_unless_asked(include, text) -> None:
    """Stopped by a stop token id (no stop string): the token id is reported, its text
    only with include_stop_str_in_output (as vLLM does)."""
    writer = _ResponseWriter("r", (5, 6, 7), _Chars(), (), include)
    msgs = writer.messages(RequestOutput("r", (0, 1, 2, 3), FinishReason.STOP))
    assert list(msgs[0].chunk.token_ids) == [0, 1, 2, 3]
    assert msgs[0].chunk.text == text

"""A continuation (GenerateRequest.continuation, the gateway's mid-stream failover): a
request re-admitted with the output another verifier already streamed produces exactly
the rest of the uninterrupted output -- greedy, seeded sampling with penalties and
min_tokens, with and without drafts -- and its text continues where the client's ends,
stop strings and multi-byte characters across the cut included."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from chainspec.engine.request import FinishReason, RequestOutput, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.codec import WireError
from chainspec.rpc.generate_codec import GenerateLimits, parse_generate
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.verifier_service import _ResponseWriter
from tests.unit.engine_fixtures import engine, prompts, tied_pair

TOKENS = 24
SAMPLED = SamplingParams(temperature=0.9, top_k=20, seed=7, presence_penalty=2.0,
                         frequency_penalty=2.0, min_tokens=6)


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


def _run(eng, prompt, params, generated=(), max_tokens=TOKENS):
    eng.add_request("r", prompt, params, StopConditions(max_tokens=max_tokens,
                                                        ignore_eos=True),
                    generated=generated)
    tokens, reason = [], None
    while eng.has_work:
        for out in eng.step():
            tokens.extend(out.new_tokens)
            reason = out.finish_reason or reason
    return tokens, reason


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SAMPLED],
                         ids=["greedy", "seeded"])
def test_a_continuation_gives_the_rest_of_the_uninterrupted_output(pair, params,
                                                                   speculative):
    target, draft = pair
    make = lambda: engine(target, draft if speculative else None)  # noqa: E731
    for prompt in prompts(3, seed=5):
        whole, reason = _run(make(), prompt, params)
        assert len(whole) == TOKENS and reason is FinishReason.LENGTH
        for cut in (1, 5, 13, TOKENS - 1):  # min_tokens (6) still pending at 1 and 5
            rest, reason = _run(make(), prompt, params, generated=whole[:cut])
            assert whole[:cut] + rest == whole, (prompt, cut)
            assert reason is FinishReason.LENGTH


def test_penalties_count_the_continued_tokens_as_generated(pair):
    """Had the continued tokens been taken as prompt, presence/frequency penalties would
    not see them: the seeded output would change (shown by running it that way)."""
    target, _ = pair
    prompt = prompts(1, seed=5)[0]
    whole, _ = _run(engine(target), prompt, SAMPLED)
    as_prompt, _ = _run(engine(target), prompt + whole[:12], SAMPLED,
                        max_tokens=TOKENS - 12)
    assert as_prompt != whole[12:]  # so the first test's equality is not automatic


def test_a_continuation_already_complete_finishes_at_once(pair):
    target, _ = pair
    prompt = prompts(1)[0]
    whole, _ = _run(engine(target), prompt, SamplingParams(temperature=0.0))
    eng = engine(target)
    rest, reason = _run(eng, prompt, SamplingParams(temperature=0.0), generated=whole)
    assert rest == [] and reason is FinishReason.LENGTH
    assert eng.allocator.num_used == 0 and not eng.by_id


def test_continued_token_ids_must_be_in_the_vocabulary(pair):
    with pytest.raises(ValueError, match="generated token ids"):
        engine(pair[0]).add_request("r", [1, 2], SamplingParams(), StopConditions(),
                                    generated=[1, 10_000])


# ------------------------------------------------------------------------ stream text


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer without merges: every UTF-8 byte is one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Backend(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, ())


def _text(writer: _ResponseWriter, ids, stop: str | None) -> str:
    """The text a client gets from the writer for `ids`, one token per engine output;
    the last output finishes (STOP at `stop`, else LENGTH)."""
    outs = [RequestOutput("r", (t,)) for t in ids[:-1]]
    outs.append(RequestOutput("r", (ids[-1],), FinishReason.STOP if stop else
                              FinishReason.LENGTH, stop))
    return "".join(m.chunk.text for o in outs for m in writer.messages(o)
                   if m.HasField("chunk"))


@pytest.mark.parametrize("stop", [None, "STOP"])
def test_resumed_text_continues_the_client_text_at_every_cut(byte_tokenizer, stop):
    """Cut the stream after every token: the text sent before the cut plus what a
    continuation's writer sends equals the uninterrupted text, so nothing held back (a
    stop-string prefix, half a character) is lost or sent twice."""
    prompt = byte_tokenizer.encode("say:")
    ids = byte_tokenizer.encode("a € 你好 ST🙂 STOP")
    stops = (stop,) if stop else ()
    whole = _text(_ResponseWriter("r", prompt, byte_tokenizer, stops), ids, stop)
    assert whole == ("a € 你好 ST🙂 " if stop else "a € 你好 ST🙂 STOP")
    held = 0
    for cut in range(1, len(ids)):
        first = _ResponseWriter("r", prompt, byte_tokenizer, stops)
        sent = "".join(m.chunk.text for t in ids[:cut]
                       for m in first.messages(RequestOutput("r", (t,))))
        held += sent != byte_tokenizer.decode(ids[:cut])  # a stop prefix, half a character
        second = _ResponseWriter("r", prompt, byte_tokenizer, stops)
        second.resume(ids[:cut], len(sent))
        assert sent + _text(second, ids[cut:], stop) == whole, cut
    assert held > 0  # some cuts fell while text was held back


def test_text_the_client_lacks_goes_out_with_the_first_chunk(byte_tokenizer):
    """A continuation whose client has less of the text than its tokens decode to (an
    older verifier held more back) gets the rest first: nothing is lost."""
    ids = byte_tokenizer.encode("hello world")
    writer = _ResponseWriter("r", byte_tokenizer.encode("say:"), byte_tokenizer, ())
    writer.resume(ids[:5], 2)  # "hello" generated, "he" sent
    assert _text(writer, ids[5:], None) == "llo world"


# ------------------------------------------------------------------------------ wire


def test_the_wire_continuation_is_parsed_and_checked():
    limits = GenerateLimits(vocab_size=61, max_len=40, num_steps=3)  # context 36
    req = pb.GenerateRequest(tokens=pb.PromptTokens(ids=[1, 2, 3]))
    assert parse_generate(req, limits, None).generated == ()  # unset: a new request
    req.continuation.token_ids.extend([4, 5])
    req.continuation.text_sent = 7
    args = parse_generate(req, limits, None)
    assert (args.prompt, args.generated, args.text_sent) == ([1, 2, 3], (4, 5), 7)
    req.continuation.token_ids.append(61)
    with pytest.raises(WireError, match=r"^continuation.token_ids\[2\] = 61"):
        parse_generate(req, limits, None)
    del req.continuation.token_ids[:]
    req.continuation.token_ids.extend([1] * 34)  # 3 + 34 > 36
    with pytest.raises(WireError, match=r"^continuation.token_ids: 3 prompt and 34"):
        parse_generate(req, limits, None)

"""Generate's wire for structured output: SamplingParams.grammar reaches the engine as a
compiled grammar of the spec sent; a bad or unusable one is INVALID_ARGUMENT naming
sampling.grammar and the problem, before the engine sees it."""

from __future__ import annotations

import grpc
import pytest

from chainspec.engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from chainspec.rpc.codec import WireError
from chainspec.rpc.generate_codec import GenerateLimits, parse_generate
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

VOCAB = ["<eos>", "a", "b", "c", "{", "}", '"', ":", " ", "1"]
LIMITS = GenerateLimits(vocab_size=len(VOCAB), max_len=128, num_steps=3, default_max_tokens=16)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.for_vocab(VOCAB, [0])


def request(grammar: pb.Grammar, ignore_eos: bool = False) -> pb.GenerateRequest:
    return pb.GenerateRequest(tokens=pb.PromptTokens(ids=[1, 2]),
                              sampling=pb.SamplingParams(grammar=grammar),
                              stop=pb.StopConditions(ignore_eos=ignore_eos))


@pytest.mark.parametrize("grammar,spec", [
    (pb.Grammar(kind=pb.GRAMMAR_KIND_REGEX, text="a+b"), GrammarSpec("regex", "a+b")),
    (pb.Grammar(kind=pb.GRAMMAR_KIND_JSON_SCHEMA, text='{"type": "integer"}'),
     GrammarSpec("json_schema", '{"type": "integer"}')),
    (pb.Grammar(kind=pb.GRAMMAR_KIND_JSON_OBJECT), GrammarSpec("json_object")),
    (pb.Grammar(kind=pb.GRAMMAR_KIND_CHOICE, choices=["ab", "c"]),
     GrammarSpec("choice", choices=("ab", "c"))),
    (pb.Grammar(kind=pb.GRAMMAR_KIND_EBNF, text='root ::= "a" "b"*'),
     GrammarSpec(GrammarKind.EBNF, 'root ::= "a" "b"*')),
])
def test_grammar_reaches_sampling_params(compiler, grammar, spec) -> None:
    args = parse_generate(request(grammar), LIMITS, None, compiler.compile)
    assert args.sampling.grammar is compiler.compile(spec)  # the same spec, cached


def test_no_grammar_is_free_text(compiler) -> None:
    args = parse_generate(pb.GenerateRequest(tokens=pb.PromptTokens(ids=[1])), LIMITS, None,
                          compiler.compile)
    assert args.sampling.grammar is None


@pytest.mark.parametrize("grammar,ignore_eos,message", [
    (pb.Grammar(kind=pb.GRAMMAR_KIND_REGEX, text="(a"), False, "sampling.grammar: invalid regex"),
    (pb.Grammar(kind=pb.GRAMMAR_KIND_JSON_SCHEMA, text='{"type": 5}'), False,
     "sampling.grammar: invalid JSON schema"),
    (pb.Grammar(kind=pb.GRAMMAR_KIND_REGEX), False,
     "sampling.grammar: a regex constraint needs its text"),
    (pb.Grammar(kind=pb.GRAMMAR_KIND_CHOICE), False,
     "sampling.grammar: a choice constraint needs at least one choice"),
    (pb.Grammar(text="a"), False, "sampling.grammar.kind: must be set"),
    (pb.Grammar(kind=pb.GRAMMAR_KIND_REGEX, text="a"), True, "stop.ignore_eos: cannot be used"),
])
def test_bad_grammar_is_invalid_argument(compiler, grammar, ignore_eos, message) -> None:
    with pytest.raises(WireError) as e:
        parse_generate(request(grammar, ignore_eos), LIMITS, None, compiler.compile)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message.startswith(message), e.value.message


def test_a_server_without_a_compiler_refuses_grammars() -> None:
    with pytest.raises(WireError, match="no tokenizer"):
        parse_generate(request(pb.Grammar(kind=pb.GRAMMAR_KIND_REGEX, text="a")), LIMITS, None)

"""Structured output fields at the gateway: every way of asking (OpenAI's response_format,
vLLM's structured_outputs and guided_*) becomes one grammar on the wire; two constraints,
a wrong shape, or a grammar that does not parse is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json

import pytest

from chainspec.gateway.client import GenerationSpec
from chainspec.gateway.errors import APIError
from chainspec.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
from chainspec.gateway.structured_output import check
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

CMPL = {"prompt": "x", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def wire(model, body) -> pb.Grammar | None:
    """The SamplingParams.grammar a body is sent with (None: free text)."""
    request = parse(model, body)
    asyncio.run(check(request.grammar_spec()))
    spec = GenerationSpec("r", "x", 4, 0.0, 1.0, 0, None, (), False,
                          processing=request.processing())
    msg = spec.message()
    return msg.sampling.grammar if msg.sampling.HasField("grammar") else None


def refusal(body, model=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as e:
        wire(model, body)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("model,base", [(CompletionRequest, CMPL), (ChatCompletionRequest, CHAT)])
@pytest.mark.parametrize("fields,kind,text,choices", [
    ({"response_format": {"type": "json_object"}}, pb.GRAMMAR_KIND_JSON_OBJECT, "", []),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}}},
     pb.GRAMMAR_KIND_JSON_SCHEMA, json.dumps(SCHEMA), []),
    ({"structured_outputs": {"json": SCHEMA}}, pb.GRAMMAR_KIND_JSON_SCHEMA,
     json.dumps(SCHEMA), []),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, pb.GRAMMAR_KIND_JSON_SCHEMA,
     '{"type": "integer"}', []),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}},
     pb.GRAMMAR_KIND_REGEX, "[0-9]+", []),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, pb.GRAMMAR_KIND_CHOICE, "",
     ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'root ::= "a"+'}}, pb.GRAMMAR_KIND_EBNF,
     'root ::= "a"+', []),
    ({"structured_outputs": {"json_object": True}}, pb.GRAMMAR_KIND_JSON_OBJECT, "", []),
    ({"guided_json": SCHEMA}, pb.GRAMMAR_KIND_JSON_SCHEMA, json.dumps(SCHEMA), []),
    ({"guided_regex": "a|b", "guided_decoding_backend": "xgrammar"},
     pb.GRAMMAR_KIND_REGEX, "a|b", []),
    ({"guided_choice": ["x"]}, pb.GRAMMAR_KIND_CHOICE, "", ["x"]),
    ({"guided_grammar": 'root ::= "b"'}, pb.GRAMMAR_KIND_EBNF, 'root ::= "b"', []),
])
def test_each_way_of_asking_reaches_the_wire(model, base, fields, kind, text, choices) -> None:
    g = wire(model, {**base, **fields})
    assert (g.kind, g.text, list(g.choices)) == (kind, text, choices)


@pytest.mark.parametrize("fields", [{}, {"response_format": {"type": "text"}},
                                    {"structured_outputs": {"json_object": False}},
                                    {"guided_decoding_backend": "auto"}])
def test_free_text_sends_no_grammar(fields) -> None:
    assert wire(CompletionRequest, {**CMPL, **fields}) is None


@pytest.mark.parametrize("fields,param,says", [
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined with guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
     "cannot be combined with structured_outputs.regex"),
    ({"guided_json": SCHEMA, "structured_outputs": {"grammar": "root ::= \"a\""}},
     "structured_outputs.grammar", "cannot be combined with guided_json"),
    ({"response_format": {}}, "response_format.type", "is required"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object'"),
    ({"guided_choice": []}, "guided_choice", "at least one choice"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "'outlines'"),
    ({"structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "Extra inputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos",
     "cannot be used with guided_regex"),
    # the grammar itself, checked with xgrammar before any verifier sees it
    ({"guided_json": {"type": "objec"}}, "guided_json", 'Unsupported type "objec"'),
    ({"guided_json": "{not json"}, "guided_json", "invalid JSON schema: not JSON"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "invalid regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format.json_schema.schema", 'invalid JSON schema: Unsupported type "nope"'),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", 'Rule "missing"'),
])
def test_bad_constraints_are_400_naming_the_field(fields, param, says) -> None:
    e = refusal({**CMPL, **fields})
    assert e.param == param, e.message
    assert e.message.startswith(f"{param}: ") and says in e.message, e.message

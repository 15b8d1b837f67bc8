"""Structured output at the gateway (DESIGN 4.13): the request fields that ask for it, one
constraint out of them, and its check before any verifier sees it.

Fields (both endpoints):
- OpenAI's `response_format`: `{"type": "text"}` (free text), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, as an object or JSON text),
  `regex`, `choice` (strings), `grammar` (EBNF), `json_object: true`; its
  `disable_fallback`, `disable_any_whitespace` and `disable_additional_properties` are
  accepted (there is one backend, and JSON is always compact: xgrammar's
  any_whitespace off); `whitespace_pattern` and `structural_tag` are refused;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and
  `guided_decoding_backend` (`xgrammar` or `auto`; any other backend is refused).

At most one constraint per request: two are a 400 naming both. A bad schema, regex or
grammar is a 400 naming the field and xgrammar's reason, checked on a worker thread
(xgrammar loads on first use and a large schema takes time to convert).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from chainspec.engine.grammar import GrammarError, GrammarKind, GrammarSpec
from chainspec.gateway.errors import invalid, unsupported
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

BACKENDS = ("xgrammar", "auto")  # guided_decoding_backend values honoured
Schema = dict[str, Any] | str  # a JSON schema as an object, or as JSON text


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None  # NOTE: the grammar is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams)."""

    model_config = ConfigDict(extra="forbid")
    json_: Schema | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_fallback: StrictBool = False
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: Any = None  # refused unless null (grammar_spec)
    structural_tag: Any = None


class GuidedFields(BaseModel):
    """vLLM's older per-kind fields, declared on the request schemas."""

    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def grammar_spec(self) -> tuple[str, GrammarSpec] | None:
        """(the field asking, its spec), or None for free text; APIError(400) for two
        constraints or one of the wrong shape."""
        backend = self.guided_decoding_backend
        if backend is not None and backend not in BACKENDS:
            raise unsupported("guided_decoding_backend", f"the {backend!r} backend (this "
                                                         f"server compiles with xgrammar)")
        found = [c for c in (*self._guided(), *self._structured(), self._response_format())
                 if c is not None]
        if len(found) > 1:
            raise invalid(found[1][0], f"cannot be combined with {found[0][0]}: one "
                                       f"structured output constraint per request")
        return found[0] if found else None

    def _guided(self) -> list[tuple[str, GrammarSpec] | None]:
        return [_spec("guided_json", GrammarKind.JSON_SCHEMA, self.guided_json),
                _spec("guided_regex", GrammarKind.REGEX, self.guided_regex),
                _spec("guided_choice", GrammarKind.CHOICE, self.guided_choice),
                _spec("guided_grammar", GrammarKind.EBNF, self.guided_grammar)]

    def _structured(self) -> list[tuple[str, GrammarSpec] | None]:
        s = self.structured_outputs
        if s is None:
            return []
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(s, name) is not None:
                raise unsupported(f"structured_outputs.{name}", name)
        return [_spec("structured_outputs.json", GrammarKind.JSON_SCHEMA, s.json_),
                _spec("structured_outputs.regex", GrammarKind.REGEX, s.regex),
                _spec("structured_outputs.choice", GrammarKind.CHOICE, s.choice),
                _spec("structured_outputs.grammar", GrammarKind.EBNF, s.grammar),
                _spec("structured_outputs.json_object", GrammarKind.JSON_OBJECT,
                      s.json_object or None)]

    def _response_format(self) -> tuple[str, GrammarSpec] | None:
        f = self.response_format
        if f is None or f.type == "text":
            if f is not None and f.json_schema is not None:
                raise invalid("response_format.json_schema", 'only with "type": '
                                                             '"json_schema"')
            return None
        if f.type == "json_object":
            return _spec("response_format", GrammarKind.JSON_OBJECT, True)
        if f.json_schema is None:
            raise invalid("response_format.json_schema", 'is required with "type": '
                                                         '"json_schema"', "missing")
        return _spec("response_format.json_schema.schema", GrammarKind.JSON_SCHEMA,
                     f.json_schema.schema_)


def _spec(param: str, kind: GrammarKind, value: Any) -> tuple[str, GrammarSpec] | None:
    if value is None:
        return None
    try:
        if kind is GrammarKind.JSON_SCHEMA:
            return param, GrammarSpec(kind, value if isinstance(value, str) else
                                      json.dumps(value, ensure_ascii=False))
        if kind is GrammarKind.CHOICE:
            return param, GrammarSpec(kind, choices=tuple(value))
        if kind is GrammarKind.JSON_OBJECT:
            return param, GrammarSpec(kind)
        return param, GrammarSpec(kind, value)
    except GrammarError as e:
        raise invalid(param, str(e)) from None


async def check(constraint: tuple[str, GrammarSpec] | None) -> None:
    """APIError(400) naming the field when the grammar does not parse."""
    if constraint is None:
        return
    param, spec = constraint
    try:
        await asyncio.to_thread(spec.check)
    except GrammarError as e:
        raise invalid(param, str(e)) from None


_WIRE_KINDS = {GrammarKind.JSON_SCHEMA: pb.GRAMMAR_KIND_JSON_SCHEMA,
               GrammarKind.JSON_OBJECT: pb.GRAMMAR_KIND_JSON_OBJECT,
               GrammarKind.REGEX: pb.GRAMMAR_KIND_REGEX,
               GrammarKind.CHOICE: pb.GRAMMAR_KIND_CHOICE,
               GrammarKind.EBNF: pb.GRAMMAR_KIND_EBNF}


def fill(spec: GrammarSpec, grammar: pb.Grammar) -> None:
    """The wire's SamplingParams.grammar."""
    grammar.kind = _WIRE_KINDS[spec.kind]
    grammar.text = spec.text
    grammar.choices.extend(spec.choices)

"""Structured output end to end, through the official `openai` client, the gateway, a
verifier and a remote drafter: greedy speculative output under a JSON schema (chat
response_format), a regex and a choice (completions, vLLM's extra fields), streamed and
not, equals plain in-process decoding under the same grammar; a bad schema or regex is a
400 naming the field and the problem, and the stack goes on serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from chainspec.engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer
from tests.integration.helpers import PROMPTS
from tests.integration.test_gateway import KEY, stack  # noqa: F401
from tests.integration.tiny_checkpoint import chat_prompt

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 64
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "c": {"enum": ["x", "y"]}}, "required": ["ok", "n", "c"]}
REGEX = "[a-f]{2}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]


def drafts_of(out) -> int:
    """Draft tokens verified for a response (the gateway's usage.speculative)."""
    return out.usage.model_extra["speculative"]["draft_tokens"]


@pytest.fixture(scope="module")
def client(stack):  # noqa: F811
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def plain(model_dir):
    """Greedy text under `spec` of an in-process engine without a drafter."""
    tok = Tokenizer.from_dir(model_dir)
    opts = LocalOptions(model_dir=model_dir, num_steps=3, max_seqs=8, max_len=512)
    models = load_models(opts, speculative=False)
    compiler = GrammarCompiler.for_tokenizer(tok, models.target.config.vocab_size,
                                             tok.eos_token_ids)

    def generate(prompts: list[str], spec: GrammarSpec) -> list[str]:
        engine = build_verifier(models, opts, False, eos_ids=tok.eos_token_ids)
        params = SamplingParams(temperature=0.0, grammar=compiler.compile(spec))
        result = run_to_completion(engine, [tok.encode(p) for p in prompts], params,
                                   StopConditions(max_tokens=MAX_TOKENS))
        return [tok.decode(c.tokens) for c in result.completions]
    return generate


def test_json_schema_chat_equals_plain(stack, client, plain) -> None:  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    want = plain([chat_prompt([("user", p)]) for p in PROMPTS],
                 GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    drafted = 0
    for prompt, expected in zip(PROMPTS, want, strict=True):
        out = client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": prompt}],
            response_format=fmt, temperature=0, max_tokens=MAX_TOKENS)
        text = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"
        drafted += drafts_of(out)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == expected, prompt
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": prompt}],
            response_format=fmt, temperature=0, max_tokens=MAX_TOKENS, stream=True)
            if c.choices)
        assert streamed == text
    assert drafted > 0  # speculative rounds (a remote drafter's) decided these tokens


@pytest.mark.parametrize("extra,spec,pattern", [
    ({"guided_regex": REGEX}, GrammarSpec(GrammarKind.REGEX, REGEX), REGEX),
    ({"structured_outputs": {"choice": CHOICES}},
     GrammarSpec(GrammarKind.CHOICE, choices=tuple(CHOICES)), "|".join(CHOICES)),
])
def test_completions_under_a_grammar_equal_plain(stack, client, plain, extra, spec,  # noqa: F811
                                                 pattern) -> None:
    want = plain(PROMPTS, spec)
    outs = [client.completions.create(model=stack.model, prompt=p, temperature=0,
                                      max_tokens=MAX_TOKENS, extra_body=extra) for p in PROMPTS]
    got = [o.choices[0].text for o in outs]
    assert got == want
    assert sum(map(drafts_of, outs)) > 0
    assert all(re.fullmatch(pattern, t) for t in got), got
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=stack.model, prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS,
        extra_body=extra, stream=True) if c.choices)
    assert streamed == got[0]


@pytest.mark.parametrize("extra,param,says", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format.json_schema.schema", 'Unsupported type "strin"'),
    ({"guided_regex": "[0-9"}, "guided_regex", "invalid regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "cannot be combined"),
])
def test_a_bad_grammar_is_400_and_the_stack_keeps_serving(stack, client, extra, param,  # noqa: F811
                                                         says) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=stack.model, prompt="a", max_tokens=4,
                                  extra_body=extra)
    body = e.value.body
    assert body["param"] == param and says in body["message"], body
    ok = client.completions.create(model=stack.model, prompt="a", max_tokens=8, temperature=0,
                                   extra_body={"guided_choice": CHOICES})
    assert ok.choices[0].text in CHOICES

"""Structured output on the demo model (issue 24): every output under a JSON schema parses
and validates; greedy speculative output equals plain under a JSON schema, a regex and a
choice at K = 1..4, and so do seeded sampled outputs (the coupled rule); a mask that
ignores the drafts before its row is caught."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from chainspec.engine import grammar as grammar_module
from chainspec.engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from chainspec.engine.local import build_verifier
from chainspec.engine.request import FinishReason, StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams

PROMPTS, MAX_TOKENS = 16, 128
SCHEMAS = {
    "object": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "age", "color"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": -99, "maximum": 999},
              "minItems": 1, "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "id": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
        "required": ["ok", "tags", "id"]},
}
REGEX = r"def [a-z_]{1,16}\((self)?\):"
CHOICES = ("True", "False", "None")
SPECS = {"json_schema": GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMAS["object"])),
         "regex": GrammarSpec(GrammarKind.REGEX, REGEX),
         "choice": GrammarSpec(GrammarKind.CHOICE, choices=CHOICES)}


@pytest.fixture(scope="module")
def compiler(demo_models, demo_tokenizer) -> GrammarCompiler:
    _, models = demo_models
    return GrammarCompiler.for_tokenizer(demo_tokenizer, models.target.config.vocab_size,
                                         demo_tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def prompts(heldout_prompts):
    return heldout_prompts[:PROMPTS]


def run(demo_models, eos, prompts, params, k: int | None):
    """Completions of `prompts`; k None: plain decoding, else speculative at K = k."""
    opts, models = demo_models
    eng = build_verifier(models, opts if k is None else dataclasses.replace(opts, num_steps=k),
                         k is not None, eos_ids=eos)
    return run_to_completion(eng, prompts, params, StopConditions(max_tokens=MAX_TOKENS))


def texts(result, tokenizer) -> list[str]:
    return [tokenizer.decode(c.tokens) for c in result.completions]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_validates_against_its_schema(demo_models, demo_tokenizer, compiler,
                                                   prompts, name) -> None:
    schema = SCHEMAS[name]
    g = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
    params = [SamplingParams(temperature=t, seed=i, grammar=g)
              for i, t in enumerate([0.0, 1.0] * (PROMPTS // 2))]  # greedy and sampled
    result = run(demo_models, demo_tokenizer.eos_token_ids, prompts, params, k=4)
    # all end by the grammar (EOS), well inside max_tokens: no truncated output to excuse
    assert [c.finish_reason for c in result.completions] == [FinishReason.EOS] * PROMPTS
    for text in texts(result, demo_tokenizer):
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts(result, demo_tokenizer))) > 1  # not one canned answer


@pytest.fixture(scope="module")
def plain(demo_models, demo_tokenizer, compiler, prompts):
    eos = demo_tokenizer.eos_token_ids
    return {name: run(demo_models, eos, prompts,
                      SamplingParams(temperature=0.0, grammar=compiler.compile(spec)), None)
            for name, spec in SPECS.items()}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_greedy_speculative_equals_plain(demo_models, demo_tokenizer, compiler, prompts,
                                         plain, name) -> None:
    base = plain[name]
    outs = texts(base, demo_tokenizer)
    if name == "regex":
        assert all(re.fullmatch(REGEX, t) for t in outs), outs
    if name == "choice":
        assert set(outs) <= set(CHOICES) and len(set(outs)) > 1, outs
    params = SamplingParams(temperature=0.0, grammar=compiler.compile(SPECS[name]))
    tokens = [c.tokens for c in base.completions]
    for k in (1, 2, 3, 4):
        spec = run(demo_models, demo_tokenizer.eos_token_ids, prompts, params, k)
        assert [c.tokens for c in spec.completions] == tokens, f"K={k}"
        assert all(c.finish_reason is FinishReason.EOS for c in spec.completions)
        drafted = sum(c.stats.draft_tokens for c in spec.completions)
        assert drafted > 0 and (name == "choice" or sum(
            c.stats.accepted_tokens for c in spec.completions) > 0)  # drafts were at stake


def test_seeded_sampled_speculative_equals_plain(demo_models, demo_tokenizer, compiler,
                                                 prompts) -> None:
    """Seeded requests take the coupled rule: their tokens are plain's keyed samples."""
    g = compiler.compile(SPECS["json_schema"])
    params = [SamplingParams(temperature=1.0, seed=100 + i, grammar=g) for i in range(PROMPTS)]
    eos = demo_tokenizer.eos_token_ids
    base = run(demo_models, eos, prompts, params, None)
    spec = run(demo_models, eos, prompts, params, 3)
    assert [c.tokens for c in spec.completions] == [c.tokens for c in base.completions]
    assert sum(c.stats.accepted_tokens for c in spec.completions) > 0


def test_a_mask_blind_to_the_drafts_is_caught(demo_models, demo_tokenizer, compiler, prompts,
                                              plain, monkeypatch) -> None:
    """Every row masked as row 0 (the drafts before it ignored): the regex's output
    breaks, so the equality above can fail."""
    def blind(self, drafts, bitmask):
        consumed = real(self, drafts, bitmask)
        bitmask[1:] = bitmask[0]
        return consumed
    real = grammar_module.GrammarMatcher.fill_window
    monkeypatch.setattr(grammar_module.GrammarMatcher, "fill_window", blind)
    params = SamplingParams(temperature=0.0, grammar=compiler.compile(SPECS["regex"]))
    with pytest.raises(RuntimeError, match="grammar forbids"):
        run(demo_models, demo_tokenizer.eos_token_ids, prompts, params, 4)


def test_a_continuation_resumes_inside_the_grammar(demo_models, demo_tokenizer, compiler,
                                                   prompts, plain) -> None:
    """A request re-opened with the output it had (the gateway's failover) feeds that
    output to its matcher first, so it ends exactly as the uninterrupted one did."""
    opts, models = demo_models
    params = SamplingParams(temperature=0.0, grammar=compiler.compile(SPECS["json_schema"]))
    eng = build_verifier(models, opts, True, eos_ids=demo_tokenizer.eos_token_ids)
    whole = [c.tokens for c in plain["json_schema"].completions[:4]]
    rest: dict[str, list[int]] = {}
    for i, tokens in enumerate(whole):
        eng.add_request(str(i), prompts[i], params, StopConditions(max_tokens=MAX_TOKENS),
                        generated=tokens[:7])
        rest[str(i)] = []
    while eng.has_work:
        for out in eng.step():
            rest[out.request_id] += out.new_tokens
    assert [tokens[:7] + rest[str(i)] for i, tokens in enumerate(whole)] == whole
    with pytest.raises(ValueError, match="does not follow the grammar"):
        eng.add_request("bad", prompts[0], params, StopConditions(max_tokens=MAX_TOKENS),
                        generated=[whole[0][1]] * 3)  # no JSON object starts so

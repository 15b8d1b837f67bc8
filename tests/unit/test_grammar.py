"""Grammar specs, the per-request matcher and the verify-row mask (engine/grammar.py,
engine/grammar_mask.py) over a hand-checkable vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from chainspec.engine.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    start_grammar,
)
from chainspec.engine.grammar_mask import GrammarMasks
from chainspec.engine.request import StopConditions

VOCAB = ["<eos>", "a", "b", "c", "d", "ab", "x", "{", "}"]
EOS, A, B, C, D, AB, X = range(7)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.for_vocab(VOCAB, [EOS], vocab_size=40)  # logits wider than vocab


def allowed(bitmask_row: torch.Tensor, vocab: int = 40) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def fresh_allowed(grammar, tokens) -> set[int]:
    """What a new matcher fed `tokens` allows next (the reference for every row)."""
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    grammar.matcher(tokens).fill_window([], bitmask)
    return allowed(bitmask[0])


@pytest.mark.parametrize("spec,message", [
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "objec"}'),
     'invalid JSON schema: Unsupported type "objec"'),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": '), "invalid JSON schema: not JSON"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '[1, 2]'), "invalid JSON schema: must be a JSON"),
    (GrammarSpec(GrammarKind.REGEX, "[a-"), "invalid regex: Regex parsing error at position"),
    (GrammarSpec(GrammarKind.EBNF, "root ::= foo"),
     'invalid grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
])
def test_bad_grammar_names_the_problem(spec, message) -> None:
    """The message starts with what is wrong, without xgrammar's "[time] file.cc:line:"."""
    with pytest.raises(GrammarError) as e:
        spec.check()
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("kwargs", [dict(kind="regex"), dict(kind="choice"),
                                    dict(kind="json_object", text="{}"),
                                    dict(kind="regex", text="a", choices=("a",)),
                                    dict(kind="choice", choices=("a", ""))])
def test_spec_shape_is_checked(kwargs) -> None:
    with pytest.raises(GrammarError):
        GrammarSpec(**kwargs)


def test_choice_escapes_quotes_and_backslashes(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.CHOICE, choices=('a"b', "c\\d")))
    m = grammar.matcher()._matcher
    assert m.accept_string('c\\d') and m.is_completed()
    m = grammar.matcher()._matcher
    assert m.accept_string('a"b') and m.is_completed()


def test_compiled_grammars_are_cached_by_spec(compiler) -> None:
    spec = GrammarSpec(GrammarKind.REGEX, "[ab]+c")
    assert compiler.compile(spec) is compiler.compile(GrammarSpec("regex", "[ab]+c"))
    assert compiler.compile(spec) is not compiler.compile(GrammarSpec("regex", "[ab]+d"))


def test_each_row_masks_after_the_drafts_before_it(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "a(bc)+d"))
    m = grammar.matcher([A])
    bitmask = torch.zeros(5, 2, dtype=torch.int32)
    consumed = m.fill_window([B, C, B], bitmask)
    assert consumed == 3
    for row, history in enumerate([[A], [A, B], [A, B, C], [A, B, C, B]]):
        assert allowed(bitmask[row]) == fresh_allowed(grammar, history), row
    assert allowed(bitmask[0]) == {B}  # hand-checked: after "a" only "b"
    assert allowed(bitmask[2]) == {B, D}
    assert allowed(bitmask[4]) == allowed(bitmask[3])  # a row past the drafts: a copy


def test_a_refused_draft_stops_the_window(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "a(bc)+d"))
    m = grammar.matcher([A])
    bitmask = torch.zeros(4, 2, dtype=torch.int32)
    assert m.fill_window([B, D, C], bitmask) == 1  # "d" after "ab" is refused
    assert allowed(bitmask[1]) == {C}
    assert allowed(bitmask[2]) == allowed(bitmask[3]) == {C}  # never judge an accepted draft


def test_settle_keeps_exactly_the_committed_output(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "a(bc)+d"))
    m = grammar.matcher([A])
    bitmask = torch.zeros(4, 2, dtype=torch.int32)
    consumed = m.fill_window([B, C, B], bitmask)
    m.settle(consumed, 1, C)  # accepted "b", then the residual "c"
    assert fresh_allowed(grammar, [A, B, C]) == {B, D}
    after = torch.zeros(1, 2, dtype=torch.int32)
    m.fill_window([], after)
    assert allowed(after[0]) == {B, D}


def test_settle_fails_loudly_when_the_mask_was_not_applied(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "a(bc)+d"))
    m = grammar.matcher([A])
    consumed = m.fill_window([C], torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="mask was not applied"):
        m.settle(consumed, 1, B)
    with pytest.raises(RuntimeError, match="forbids"):
        grammar.matcher([A]).settle(0, 0, D)


def test_an_accepted_stop_draft_ends_the_grammar(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "ab"))
    m = grammar.matcher([A, B])
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    assert m.fill_window([EOS, A], bitmask) == 1
    assert allowed(bitmask[0]) == {EOS}
    m.settle(1, 1, A)  # the token after an accepted EOS is never committed
    assert m.terminated


def test_masks_apply_to_grammar_windows_only(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "a(bc)+d"))
    masks = GrammarMasks.build([grammar.matcher([A]), None], [[B], [C]], 3, 40)
    logits = torch.randn(2, 3, 40)
    out = masks.apply(logits)
    assert torch.equal(out[1], logits[1])  # no grammar: untouched
    for row, ok in enumerate([{B}, {C}, {C}]):
        finite = set(torch.isfinite(out[0, row]).nonzero().flatten().tolist())
        assert finite == ok
        assert torch.equal(out[0, row, list(ok)], logits[0, row, list(ok)])
    assert GrammarMasks.build([None, None], [[], []], 3, 40) is None


def test_a_row_left_empty_falls_back_to_the_grammar(compiler) -> None:
    """min_tokens masks EOS where a complete grammar allows nothing else."""
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "ab"))
    masks = GrammarMasks.build([grammar.matcher([A, B])], [[]], 1, 40)
    raw = torch.randn(1, 1, 40)
    processed = raw.clone()
    processed[0, 0, EOS] = -math.inf
    out = masks.apply(processed, raw)
    assert torch.isfinite(out[0, 0]).nonzero().flatten().tolist() == [EOS]


def test_start_refuses_what_cannot_run(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "ab"))
    with pytest.raises(ValueError, match="ignore_eos"):
        start_grammar(grammar, (), StopConditions(ignore_eos=True), 40)
    with pytest.raises(ValueError, match="vocabulary of 40"):
        start_grammar(grammar, (), StopConditions(), 41)
    with pytest.raises(ValueError, match="does not follow"):
        start_grammar(grammar, (A, A), StopConditions(), 40)
    assert not start_grammar(grammar, (A,), StopConditions(), 40).terminated


def test_guide_drafts_what_the_grammar_forces(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "a(bc)+d"))
    m = grammar.matcher([A])  # "a": "bc" is forced next ("b", then "c")
    assert m.guide([X, X, X]) == ([B, C], [True, True])  # drafts for other text dropped
    assert fresh_allowed(grammar, [A]) == {B}
    after = torch.zeros(1, 2, dtype=torch.int32)
    m.fill_window([], after)
    assert allowed(after[0]) == {B}  # the matcher is left as it was


def test_guide_keeps_the_first_refused_draft_and_stops(compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "[ab]+[cd]"))
    m = grammar.matcher([A])
    assert m.guide([B, X, A, C]) == ([B, X], [False, False])  # X is rejected by the verifier
    # after "c" only EOS may follow: "d" is refused, kept, and ends the drafts
    assert m.guide([B, C, D, A]) == ([B, C, D], [False, False, False])
    assert m.guide([]) == ([], [])

"""Structured output (DESIGN 4.13): grammars compiled by xgrammar, and the matcher that
follows one request's committed tokens.

- `GrammarSpec` is what a client asked for (a JSON schema, any JSON object, a regex, a
  choice of strings, an EBNF grammar): a hashable value, checked by `GrammarSpec.check`
  with no tokenizer (the gateway's 400 for a bad one).
- `GrammarCompiler` holds the model's vocabulary as xgrammar sees it and compiles specs
  into `Grammar`s, cached by spec. The grammar's stop tokens are the engine's EOS ids, so
  a grammar ends exactly where an EOS is committed.
- `GrammarMatcher` is one request's state: xgrammar's matcher over the committed output.
  `engine/grammar_mask.py` uses it to mask each verify row and to settle after acceptance.

JSON is compact (xgrammar's `any_whitespace=False`: `{"a": 1, "b": [2, 3]}`): with free
whitespace a model can emit blanks until max_tokens without breaking the grammar (vLLM's
`disable_any_whitespace` exists for the same reason).

xgrammar (and the transformers it imports) loads on first use, so nothing pays for it
until a grammar is compiled or checked.
"""

from __future__ import annotations

import enum
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Warning: )?")  # "[00:28:10] x.cc:94: "
CACHE_SIZE = 256  # compiled grammars kept per compiler (least recently used go first)


class GrammarError(ValueError):
    """A grammar that does not parse or cannot be compiled; the message says why."""


class GrammarKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    EBNF = "grammar"


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint. `text`: the schema (JSON text), regex or EBNF grammar; `choices`:
    the strings of a CHOICE. JSON_OBJECT takes neither."""

    kind: GrammarKind
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))
        object.__setattr__(self, "choices", tuple(self.choices))
        takes_text = self.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.REGEX,
                                   GrammarKind.EBNF)
        if takes_text and not self.text:
            raise GrammarError(f"a {self.kind} constraint needs its text")
        if not takes_text and self.text:
            raise GrammarError(f"a {self.kind} constraint takes no text")
        if (self.kind is GrammarKind.CHOICE) != bool(self.choices):
            raise GrammarError("a choice constraint needs at least one choice" if
                               self.kind is GrammarKind.CHOICE else
                               f"a {self.kind} constraint takes no choices")
        if any(not c for c in self.choices):
            raise GrammarError("choices must be non-empty strings")

    def build(self) -> Any:
        """The xgrammar `Grammar`; raises GrammarError naming the problem."""
        xgr = _xgrammar()
        if self.kind is GrammarKind.JSON_SCHEMA:
            _check_schema_json(self.text)
        try:
            if self.kind is GrammarKind.JSON_SCHEMA:
                return xgr.Grammar.from_json_schema(self.text, any_whitespace=False)
            if self.kind is GrammarKind.JSON_OBJECT:
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if self.kind is GrammarKind.REGEX:
                return xgr.Grammar.from_regex(self.text)
            return xgr.Grammar.from_ebnf(self.text if self.kind is GrammarKind.EBNF
                                         else choice_ebnf(self.choices))
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's C++ errors
            raise GrammarError(f"invalid {_NAMES[self.kind]}: {clean_message(e)}") from None

    def check(self) -> None:
        """Raises GrammarError if the grammar does not parse (no tokenizer needed)."""
        self.build()


_NAMES = {GrammarKind.JSON_SCHEMA: "JSON schema", GrammarKind.JSON_OBJECT: "JSON object",
          GrammarKind.REGEX: "regex", GrammarKind.CHOICE: "choice",
          GrammarKind.EBNF: "grammar"}


def _check_schema_json(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid JSON schema: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise GrammarError("invalid JSON schema: must be a JSON object")


def choice_ebnf(choices: Sequence[str]) -> str:
    """`root ::= "a" | "b"`; JSON string escapes are EBNF's own."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def clean_message(error: BaseException) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    lines = [_XGR_PREFIX.sub("", line).strip() for line in str(error).splitlines()]
    return " ".join(line for line in lines if line) or type(error).__name__


@dataclass(frozen=True, eq=False)
class Grammar:
    """A spec compiled for one vocabulary: what `SamplingParams.grammar` holds."""

    spec: GrammarSpec
    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int  # the logits' width the bitmask covers
    stop_ids: frozenset[int]  # tokens that end the grammar (the engine's EOS ids)

    def matcher(self, generated: Sequence[int] = ()) -> GrammarMatcher:
        return GrammarMatcher(self, generated)


class GrammarCompiler:
    """xgrammar's compiler over one model's vocabulary, with compiled grammars cached by
    spec. Thread-safe: the verifier service compiles off its event loop."""

    def __init__(self, tokenizer_info: Any, cache_size: int = CACHE_SIZE) -> None:
        self.info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.stop_ids = frozenset(tokenizer_info.stop_token_ids)
        if not self.stop_ids:
            raise GrammarError("the model has no end-of-sequence token to end a grammar with")
        self._compiler = _xgrammar().GrammarCompiler(tokenizer_info, max_threads=1)
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_ids: Sequence[int]
                      ) -> GrammarCompiler:
        """Over a `models.tokenizer.Tokenizer`; `vocab_size` is the logits' width (may
        exceed the tokenizer's: padding rows are never allowed)."""
        xgr = _xgrammar()
        from transformers import PreTrainedTokenizerFast  # NOTE: xgrammar imports it too
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        return cls(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                      stop_token_ids=list(eos_ids)))

    @classmethod
    def for_vocab(cls, tokens: Sequence[str], eos_ids: Sequence[int],
                  vocab_size: int | None = None) -> GrammarCompiler:
        """Over a plain vocabulary: token i is the text `tokens[i]` (tests)."""
        xgr = _xgrammar()
        return cls(xgr.TokenizerInfo(list(tokens), xgr.VocabType.RAW,
                                     vocab_size=vocab_size or len(tokens),
                                     stop_token_ids=list(eos_ids)))

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar (cached); raises GrammarError."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        grammar = Grammar(spec, self._compile(spec), self.vocab_size, self.stop_ids)
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: GrammarSpec) -> Any:
        built = spec.build()
        try:
            return self._compiler.compile_grammar(built)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"cannot compile the {_NAMES[spec.kind]}: "
                               f"{clean_message(e)}") from None


class GrammarMatcher:
    """One request's grammar state. Between engine steps it has consumed exactly the
    committed output; inside a step it also holds the drafts `fill_window` consumed until
    `settle` rolls back the rejected ones and takes the step's last token."""

    def __init__(self, grammar: Grammar, generated: Sequence[int] = ()) -> None:
        self.grammar = grammar
        self._matcher = _xgrammar().GrammarMatcher(grammar.compiled)  # unbounded rollback
        for i, tok in enumerate(generated):
            if not self._matcher.accept_token(tok):
                raise GrammarError(f"generated token {i} ({tok}) does not follow the grammar")

    @property
    def terminated(self) -> bool:
        """Whether the grammar has ended (a stop token was committed)."""
        return self._matcher.is_terminated()

    def fill_window(self, drafts: Sequence[int], bitmask) -> int:
        """Row i of `bitmask` [R, W] int32 (R > len(drafts)) <- the tokens allowed after
        the committed output and drafts d_1..d_i. Stops at the first draft the grammar
        refuses (or that ends it): the rows after it copy the last filled row (the drafts
        they would judge are never accepted). Returns the drafts consumed."""
        m = self._matcher
        m.fill_next_token_bitmask(bitmask, 0)
        consumed = 0
        for tok in drafts:
            if not m.accept_token(tok):
                break
            consumed += 1
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(bitmask, consumed)
        filled = consumed + (0 if m.is_terminated() else 1)
        bitmask[filled:] = bitmask[filled - 1]
        return consumed

    def guide(self, drafts: Sequence[int]) -> tuple[list[int], list[bool]]:
        """Drafts for the next window, at most len(drafts): the drafter's until one the
        grammar refuses (kept: the verifier rejects it with the residual), and where the
        grammar forces text (xgrammar's jump-forward tokens) those tokens instead, after
        which the drafter's, drafted for other text, are dropped. Returns (tokens, forced
        per token); the matcher is left as it was.
        NOTE: lossless only because every choice here depends on the drafts before a
        position, never on the draft at it: cutting a refused draft itself would give
        Leviathan's rule a proposal it did not sample from (caught by
        tests/unit/test_distribution_grammar.py)."""
        m, out, forced, taken = self._matcher, [], [], 0
        while len(out) < len(drafts) and not m.is_terminated():
            jump = m.find_jump_forward_tokens()
            if jump:
                for tok in jump[:len(drafts) - len(out)]:
                    if not m.accept_token(tok):
                        break
                    taken += 1
                    out.append(tok)
                    forced.append(True)
                break
            out.append(drafts[len(out)])
            forced.append(False)
            if not m.accept_token(out[-1]):
                break  # refused: the drafts after it are never reached
            taken += 1
        m.rollback(taken)
        return out, forced

    def settle(self, consumed: int, accepted: int, next_token: int) -> None:
        """After acceptance: keep the `accepted` drafts, then take `next_token` (unless an
        accepted draft ended the grammar: the request ends there)."""
        if accepted > consumed:
            raise RuntimeError(f"{accepted} drafts accepted but only {consumed} follow the "
                               f"grammar: the mask was not applied")
        self._matcher.rollback(consumed - accepted)
        if not self._matcher.is_terminated() and not self._matcher.accept_token(next_token):
            raise RuntimeError(f"token {next_token} was chosen where the grammar forbids it")


def start_grammar(grammar: Grammar, generated: Sequence[int], stop, vocab: int
                  ) -> GrammarMatcher:
    """A new request's matcher over the output it already has (a continuation's). Raises
    ValueError for what cannot run: ignore_eos (the grammar's end is an EOS), a grammar of
    another vocabulary, output the grammar refuses. `stop`: the StopConditions."""
    if stop.ignore_eos:
        raise GrammarError("ignore_eos cannot be used with a grammar: the grammar ends the "
                           "output with an end-of-sequence token")
    if grammar.vocab_size != vocab:
        raise GrammarError(f"the grammar was compiled for a vocabulary of "
                           f"{grammar.vocab_size} tokens, the model has {vocab}")
    return grammar.matcher(generated)


def _xgrammar():
    import xgrammar  # NOTE: ~1 s (it imports transformers); only where grammars are used
    return xgrammar

"""`Verifier.Generate` messages to and from engine values, with strict validation.

Every bad field is a `WireError(INVALID_ARGUMENT)` whose message starts with the field's
path in `GenerateRequest` (`prompt.tokens.ids[3]`, `sampling.top_p`, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from chainspec.engine.admission import OWN_PARTY, Admission, SchedulingPolicy, check_priority
from chainspec.engine.grammar import Grammar, GrammarError, GrammarKind, GrammarSpec
from chainspec.engine.logprobs import TokenLogprob
from chainspec.engine.request import FinishReason, RequestOutput, RequestStats, StopConditions
from chainspec.engine.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    REPETITION_PENALTY,
    SamplingParams,
)
from chainspec.rpc.codec import check_tokens, invalid
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

FLOAT32_TINY = 2.0 ** -126  # float32's smallest normal number


@dataclass(frozen=True)
class GenerateLimits:
    """What the server can take: vocab, context, and the default output length."""

    vocab_size: int
    max_len: int  # slot length of the verifier's KV cache
    num_steps: int  # K: a verify window needs K + 1 positions past the last token
    default_max_tokens: int = 256
    max_text_chars: int | None = None  # longer prompt texts are refused untokenized
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS  # fcfs: priority must be 0

    @property
    def context(self) -> int:
        """Longest prompt + output a request may have."""
        return self.max_len - 1 - self.num_steps


@dataclass(frozen=True)
class GenerateArgs:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    stop: StopConditions
    include_stop_str: bool = False  # the matched stop string stays in the text
    admission: Admission = OWN_PARTY  # priority and party (engine/admission.py)
    num_speculative_tokens: int | None = None  # the request's cap on drafts per round
    generated: tuple[int, ...] = ()  # a continuation's output so far (another verifier's)
    text_sent: int = 0  # characters of that output's text the client already has
    cache_salt: str | None = None  # shares cached prefix blocks only with the same salt


def parse_generate(req: pb.GenerateRequest, limits: GenerateLimits,
                   encode: Callable[[str], list[int]] | None,
                   compile_grammar: Callable[[GrammarSpec], Grammar] | None = None
                   ) -> GenerateArgs:
    """`compile_grammar`: for sampling.grammar (None: this server takes no grammars).
    NOTE: compiling can take a while for a large vocabulary: run off the event loop."""
    prompt = _prompt(req, limits, encode)
    sampling = _sampling(req, limits.vocab_size)
    if req.sampling.HasField("grammar"):
        if req.stop.ignore_eos:
            raise invalid("stop.ignore_eos: cannot be used with sampling.grammar (the "
                          "grammar ends the output with an end-of-sequence token)")
        sampling = replace(sampling, grammar=_grammar(req.sampling.grammar, compile_grammar))
    wanted = req.stop.max_tokens or limits.default_max_tokens
    if sampling.min_tokens > wanted:
        raise invalid(f"sampling.min_tokens: must be <= stop.max_tokens ({wanted}), got "
                      f"{sampling.min_tokens}")
    generated = _continuation(req, limits, len(prompt))
    return GenerateArgs(req.request_id, prompt, sampling, _stop(req, limits, len(prompt)),
                        req.stop.include_stop_str_in_output, _admission(req, limits),
                        req.num_speculative_tokens
                        if req.HasField("num_speculative_tokens") else None,
                        generated, req.continuation.text_sent, req.cache_salt or None)


def _continuation(req: pb.GenerateRequest, limits: GenerateLimits,
                  prompt_len: int) -> tuple[int, ...]:
    """The output a continued request already has (empty: a new request)."""
    if not req.HasField("continuation"):
        return ()
    ids = check_tokens(req.continuation.token_ids, limits.vocab_size,
                       name="continuation.token_ids")
    if prompt_len + len(ids) > limits.context:  # equal: finished at admission (LENGTH)
        raise invalid(f"continuation.token_ids: {prompt_len} prompt and {len(ids)} generated "
                      f"tokens do not fit the context of {limits.context} tokens")
    return tuple(ids)


def _admission(req: pb.GenerateRequest, limits: GenerateLimits) -> Admission:
    try:
        check_priority(req.priority, limits.scheduling_policy)
    except ValueError as e:
        raise invalid(f"priority: {e}") from None
    return Admission(req.priority, req.parent_request_id or None)


def _prompt(req: pb.GenerateRequest, limits: GenerateLimits,
            encode: Callable[[str], list[int]] | None) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt: one of prompt.text or prompt.tokens is required")
    if kind == "text":
        if encode is None:
            raise invalid("prompt.text: this server has no tokenizer; send prompt.tokens")
        text = req.text  # NOTE: each access copies the string
        if limits.max_text_chars is not None and len(text) > limits.max_text_chars:
            raise invalid(f"prompt.text: {len(text)} characters cannot fit the context of "
                          f"{limits.context} tokens (at most {limits.max_text_chars} "
                          f"characters are taken)")
        ids = encode(text)
        if not ids:
            raise invalid("prompt.text: the prompt is empty")
    else:
        ids = check_tokens(req.tokens.ids, limits.vocab_size, name="prompt.tokens.ids",
                           min_count=1)
    if len(ids) >= limits.context:
        raise invalid(f"prompt.{kind}: {len(ids)} prompt tokens do not fit the context of "
                      f"{limits.context} tokens (at least one must be left to generate)")
    return ids


def _sampling(req: pb.GenerateRequest, vocab: int) -> SamplingParams:
    if not req.HasField("sampling"):
        return SamplingParams(temperature=0.0)
    s = req.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise invalid(f"sampling.temperature: must be a finite number >= 0, got {s.temperature}")
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise invalid(f"sampling.top_p: must be in [0, 1] (0 or 1: off), got {s.top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NOTE: false for NaN
            raise invalid(f"sampling.{name}: must be in [-2, 2], got {value}")
    repetition = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    lo, hi = REPETITION_PENALTY
    if not lo <= repetition <= hi:  # NOTE: false for NaN
        raise invalid(f"sampling.repetition_penalty: must be in [{lo}, {hi}] (penalized "
                      f"logits stay finite), got {repetition}")
    if not 0 <= s.min_p <= 1:
        raise invalid(f"sampling.min_p: must be in [0, 1], got {s.min_p}")
    for name in ("top_p", "presence_penalty", "frequency_penalty", "min_p"):
        _check_normal(f"sampling.{name}", getattr(s, name))
    if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
        raise invalid(f"sampling.logprobs: at most {MAX_LOGPROBS}, got {s.logprobs}")
    return SamplingParams(temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p if s.top_p > 0 else 1.0,
                          seed=s.seed if s.HasField("seed") else None,
                          presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty,
                          repetition_penalty=repetition, logit_bias=_logit_bias(s, vocab),
                          min_p=s.min_p, min_tokens=s.min_tokens,
                          num_logprobs=s.logprobs if s.HasField("logprobs") else None)


_GRAMMAR_KINDS = {pb.GRAMMAR_KIND_JSON_SCHEMA: GrammarKind.JSON_SCHEMA,
                  pb.GRAMMAR_KIND_JSON_OBJECT: GrammarKind.JSON_OBJECT,
                  pb.GRAMMAR_KIND_REGEX: GrammarKind.REGEX,
                  pb.GRAMMAR_KIND_CHOICE: GrammarKind.CHOICE,
                  pb.GRAMMAR_KIND_EBNF: GrammarKind.EBNF}


def _grammar(g: pb.Grammar, compile_grammar: Callable[[GrammarSpec], Grammar] | None
             ) -> Grammar:
    if compile_grammar is None:
        raise invalid("sampling.grammar: this server has no tokenizer to compile grammars "
                      "with")
    kind = _GRAMMAR_KINDS.get(g.kind)
    if kind is None:
        raise invalid(f"sampling.grammar.kind: must be set to a known kind, got {g.kind}")
    try:
        return compile_grammar(GrammarSpec(kind, g.text, tuple(g.choices)))
    except GrammarError as e:
        raise invalid(f"sampling.grammar: {e}") from None


def _logit_bias(s: pb.SamplingParams, vocab: int) -> dict[int, float]:
    for tok, bias in s.logit_bias.items():
        if tok >= vocab:
            raise invalid(f"sampling.logit_bias[{tok}]: token id must be < {vocab}")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid(f"sampling.logit_bias[{tok}]: must be in [-100, 100], got {bias}")
        _check_normal(f"sampling.logit_bias[{tok}]", bias)
    return dict(s.logit_bias)


def _check_normal(path: str, value: float) -> None:
    """A nonzero float32 must be normal (the gateway refuses denormals the same way)."""
    if value != 0 and abs(value) < FLOAT32_TINY:
        raise invalid(f"{path}: must be 0 or at least {FLOAT32_TINY:.8g} in magnitude "
                      f"(a denormal float32), got {value}")


def _stop(req: pb.GenerateRequest, limits: GenerateLimits, prompt_len: int) -> StopConditions:
    s = req.stop
    for i, text in enumerate(s.stop):
        if not text:
            raise invalid(f"stop.stop[{i}]: stop strings must be non-empty")
    check_tokens(s.stop_token_ids, limits.vocab_size, name="stop.stop_token_ids")
    # NOTE: max_tokens 0 means the server's default (proto3 cannot tell unset from 0);
    # any request is clamped to the context left after its prompt (finish: LENGTH).
    wanted = s.max_tokens or limits.default_max_tokens
    return StopConditions(max_tokens=min(wanted, limits.context - prompt_len),
                          stop_token_ids=tuple(s.stop_token_ids), stop_strings=tuple(s.stop),
                          ignore_eos=s.ignore_eos)


# ------------------------------------------------------------------------- responses

_REASONS = {FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.STOP: pb.FINISH_REASON_STOP,
            FinishReason.EOS: pb.FINISH_REASON_EOS, FinishReason.ABORT: pb.FINISH_REASON_ABORT,
            FinishReason.ERROR: pb.FINISH_REASON_ERROR}


def chunk_message(request_id: str, tokens: tuple[int, ...], text: str,
                  logprobs: tuple[TokenLogprob, ...] | None = None) -> pb.GenerateResponse:
    chunk = pb.TokenChunk(token_ids=tokens, text=text)
    for lp in logprobs or ():
        chunk.logprobs.append(pb.TokenLogprob(
            token_id=lp.token, logprob=lp.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]))
    return pb.GenerateResponse(request_id=request_id, chunk=chunk)


def finished_message(request_id: str, out: RequestOutput, prompt_tokens: int,
                     completion_tokens: int) -> pb.GenerateResponse:
    finished = pb.GenerateFinished(reason=_REASONS[out.finish_reason], message=out.error or "")
    finished.stats.CopyFrom(stats_message(out.stats, prompt_tokens, completion_tokens))
    return pb.GenerateResponse(request_id=request_id, finished=finished)


def stats_message(stats: RequestStats | None, prompt_tokens: int,
                  completion_tokens: int) -> pb.RequestStats:
    msg = pb.RequestStats(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    if stats is not None:
        msg.rounds = stats.rounds + stats.fallback_rounds
        msg.draft_tokens = stats.draft_tokens
        msg.accepted_tokens = stats.accepted_tokens
        msg.accepted_per_position.extend(stats.accepted_per_pos)
        msg.fallback_rounds = stats.fallback_rounds
        msg.cached_tokens = stats.cached_tokens
    return msg

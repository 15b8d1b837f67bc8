"""Request bodies of `/v1/completions` and `/v1/chat/completions`, validated.

The fields declared here are honoured; every other field goes through
`params.check_extras` (a documented no-op, refused at any "on" value, or an unknown
parameter: 400 naming it; never ignored silently). vLLM extensions honoured: `top_k`
(0 or -1: off), `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`request_id`, chat `echo`, `add_generation_prompt`, `continue_final_message`,
`chat_template`, `chat_template_kwargs`. Defaults follow OpenAI: temperature 1, top_p 1;
completions default to 16 tokens, chat to the rest of the context (both clamped to the
context the prompt leaves).

Types are strict: a boolean is JSON true/false, a number a JSON number (`"yes"`, `1` for a
boolean and `"5"`, `true` for a number are 400). Every value is bounded to the range of
its wire field (`verifier.proto`: uint32 `max_tokens`, `top_k` and token ids, uint64
`seed`) before `GenerationSpec.message` converts it.

Floats are bounded where the engine's arithmetic stays finite (docs/design.md, "Extreme
values"): temperature in [0, 2], below `GREEDY_BELOW` (vLLM's 1e-5) it is greedy;
top_p in (0, 1], min_p in [0, 1], presence/frequency penalties in [-2, 2], logit_bias
values in [-100, 100], repetition_penalty in `REPETITION_PENALTY`; every other nonzero
value must be a normal float32 (|x| >= 2**-126, the wire's type): a denormal is 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationError,
    field_validator,
)

from chainspec.engine.grammar import GrammarSpec
from chainspec.gateway.client import Processing
from chainspec.gateway.config import MAX_N_LIMIT
from chainspec.gateway.errors import APIError, field_name, invalid, unsupported
from chainspec.gateway.params import REFUSED, check_extras
from chainspec.gateway.structured_output import GuidedFields

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # alternatives per token (the wire's bound)
MAX_N = MAX_N_LIMIT  # choices per request (n verifier requests); GatewayConfig.max_n caps it
INT32 = 2 ** 31  # bound of the wire's priority (exclusive, both signs)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
UINT32 = 2 ** 32  # bounds of the wire's integer fields (exclusive)
UINT64 = 2 ** 64
REST_OF_CONTEXT = UINT32 - 1  # chat's default max_tokens: the verifier clamps it to the context

FLOAT32_TINY = 2.0 ** -126  # float32's smallest normal number (1.1754944e-38)
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy
# NOTE: repetition divides seen positive logits: with [0.01, 100] and temperature >= 1e-5
# a processed logit stays below 1e7 x the model's, far inside float32's range
REPETITION_PENALTY = (0.01, 100.0)


def _normal(value: float) -> float:
    if value != 0 and abs(value) < FLOAT32_TINY:
        raise ValueError(f"must be 0 or at least {FLOAT32_TINY:.8g} in magnitude (float32's "
                         f"smallest normal number; smaller values are denormal on the "
                         f"float32 wire), got {value!r}")
    return value


Int = Annotated[int, Strict()]  # a JSON integer: not true, "5" or 5.0
Float = Annotated[float, Strict()]  # a JSON number: not true or "0.5"
Normal = Annotated[float, Strict(), AfterValidator(_normal)]  # and no float32 denormal
Bool = StrictBool  # JSON true or false only
TokenId = Annotated[int, Strict(), Field(ge=0, lt=UINT32)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class Speculative(BaseModel):
    """`speculative` (an extension): the request's cap on drafts per round; 0: off."""

    model_config = ConfigDict(extra="forbid")
    num_speculative_tokens: Int = Field(ge=0, lt=UINT32)


class _Sampling(GuidedFields):
    """What both endpoints share (the structured output fields: `GuidedFields`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=0, lt=UINT32)  # 0: echo only (completions)
    temperature: Float = Field(1.0, ge=0, le=2)
    top_p: Normal = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=-1, lt=UINT32)
    seed: Int | None = Field(None, ge=0, lt=UINT64)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list,
                                          max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: Bool = False
    n: Int = Field(1, ge=1, le=MAX_N)
    priority: Int = Field(0, ge=-INT32, lt=INT32)  # vLLM's: lower first (verifier policy)
    speculative: Speculative | None = None  # depth cap (DESIGN 4.11); output is unchanged
    # vLLM's: prefix cache blocks shared only within one salt; output is unchanged
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    best_of: Int | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: Bool = False
    request_id: str | None = Field(None, min_length=1, max_length=128)
    presence_penalty: Normal = Field(0.0, ge=-2, le=2)
    frequency_penalty: Normal = Field(0.0, ge=-2, le=2)
    repetition_penalty: Normal = Field(1.0, ge=REPETITION_PENALTY[0],
                                       le=REPETITION_PENALTY[1])
    logit_bias: dict[str, Normal] | None = None
    min_p: Normal = Field(0.0, ge=0, le=1)
    min_tokens: Int = Field(0, ge=0, lt=UINT32)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError("must be a string or a list of strings")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
        if not all(items):
            raise ValueError("stop strings must not be empty")
        return items

    @field_validator("temperature")
    @classmethod
    def _greedy_below(cls, value: float) -> float:
        return 0.0 if value < GREEDY_BELOW else value

    @field_validator("request_id")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        bad = next((i for i, c in enumerate(value or "") if not c.isprintable()), None)
        if bad is not None:  # NOTE: the id is echoed into the response id and logs
            raise ValueError(f"must be printable text (no CR, LF or other control "
                             f"characters), got {value[bad]!r} at index {bad}")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids(cls, value: Any) -> Any:
        return [] if value is None else value

    def check_supported(self) -> None:
        """Refuse what the server cannot do (raises APIError)."""
        check_extras(self.model_extra or {}, REFUSED)
        self.processing()  # logit_bias keys
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", f"best_of = {self.best_of} other than n = {self.n} "
                                         f"(ranking candidates needs their logprobs)")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "only allowed when stream is true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise unsupported("stream_options.continuous_usage_stats",
                              "usage on every chunk")
        constraint = self.grammar_spec()  # one, of the right shape (parsed in routes)
        if constraint is not None and self.ignore_eos:
            raise invalid("ignore_eos", f"cannot be used with {constraint[0]} (the grammar "
                                        f"ends the output with an end-of-sequence token)")
        if self.max_tokens == 0 and not self.prompt_only:
            raise invalid("max_tokens", "must be >= 1 (0 only with echo on /v1/completions, "
                                        "which returns the prompt alone)")
        limit = self.output_limit
        if limit is not None and self.min_tokens > limit:
            raise invalid("min_tokens", f"must be <= max_tokens ({limit})")

    def processing(self) -> Processing:
        bias, keys = [], {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) < UINT32):
                raise invalid(f"logit_bias.{key}", "keys must be token ids")
            if not -100 <= value <= 100:
                raise invalid(f"logit_bias.{key}", "must be in [-100, 100]")
            if int(key) in keys:  # "5" and "05": one wire map entry, one bias would be lost
                raise invalid(f"logit_bias.{key}", f"names token {int(key)} again (as "
                                                   f"{keys[int(key)]!r} before)")
            keys[int(key)] = key
            bias.append((int(key), value))
        return Processing(self.presence_penalty, self.frequency_penalty,
                          self.repetition_penalty, tuple(sorted(bias)), self.min_p,
                          self.min_tokens, self.num_logprobs, self._grammar())

    def _grammar(self) -> GrammarSpec | None:
        constraint = self.grammar_spec()
        return None if constraint is None else constraint[1]

    @property
    def num_logprobs(self) -> int | None:
        return None

    @property
    def prompt_only(self) -> bool:
        """Whether max_tokens 0 is allowed (the answer is the echoed prompt alone)."""
        return False

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: Any = None
    echo: Bool = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and not isinstance(self.prompt_value(), str):
            raise unsupported("echo", "echo of a token-id prompt (the gateway has no "
                                      "tokenizer to show it as text)")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "echo with logprobs (prompt logprobs)")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_only(self) -> bool:
        return self.echo  # vLLM: echo with max_tokens 0 returns the prompt

    def prompt_value(self) -> str | list[int]:
        """The one prompt, as text or token ids."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise invalid("prompt", "must not be empty")
            return p
        if isinstance(p, list) and p and all(_is_token(t) for t in p):
            return p
        if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
            raise unsupported("prompt", "more than one prompt per request")
        raise invalid("prompt", "must be a non-empty string or a non-empty list of token ids")

    @property
    def output_limit(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")  # e.g. cache_control: 400 naming it
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # NOTE: forbid, not ignore: tool_calls, tool_call_id, audio... would otherwise be
    # dropped silently; the 400 names the field (messages[i].tool_calls)
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1, lt=UINT32)
    echo: Bool = False
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs = true")
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and \
                    self.add_generation_prompt:
                raise invalid("continue_final_message", "cannot be used with "
                                                        "add_generation_prompt = true")
            if self.messages[-1].role != "assistant":
                raise invalid("continue_final_message", "the last message must be the "
                                                        "assistant's")

    @property
    def output_limit(self) -> int:
        """Unset: the rest of the context (vLLM's default; the verifier clamps every
        max_tokens to the context the prompt leaves)."""
        return self.max_completion_tokens or self.max_tokens or REST_OF_CONTEXT

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def generation_prompt(self) -> bool:
        return self.add_generation_prompt and not self.continue_final_message

    @property
    def echo_text(self) -> str:
        """vLLM's chat echo: the last message's content when it is the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < UINT32


def parse(model: type[_Sampling], body: Any) -> Any:
    """A validated request, or APIError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise _first_error(e) from None
    request.check_supported()
    return request


def _first_error(e: ValidationError) -> APIError:
    errors = e.errors()
    err = errors[0]
    # NOTE: a union (content: str | parts) reports one error per branch; the deepest
    # names the actual culprit (messages[0].content[0].cache_control, not "a string")
    if len({tuple(x["loc"][:2]) for x in errors}) == 1:
        err = max(errors, key=lambda x: len(x["loc"]))
    loc = [part for part in err["loc"] if part not in ("str", "list[ContentPart]")]
    param = field_name(loc)
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        message = "is required"
    return invalid(param, message, "missing" if err["type"] == "missing" else
                   "invalid_value")

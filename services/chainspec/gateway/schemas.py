"""Request bodies of `/v1/completions` and `/v1/chat/completions`, validated.

Fields OpenAI defines and this server cannot honour (n > 1, logprobs, tools, penalties,
...) are refused with 400 naming the field; fields it does not know are ignored, as
OpenAI's own API does for forward compatibility. Extensions: `top_k` (0 or -1: off) and
`ignore_eos`. Defaults follow OpenAI: temperature 1, top_p 1; completions default to 16
tokens, chat to the verifier's default (both clamped to the context the prompt leaves).

Types are strict: a boolean is JSON true/false, a number a JSON number (`"yes"`, `1` for a
boolean and `"5"`, `true` for a number are 400). Every value is bounded to the range of
its wire field (`verifier.proto`: uint32 `max_tokens`, `top_k` and token ids, uint64
`seed`) before `GenerationSpec.message` converts it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationError,
    field_validator,
)

from chainspec.gateway.errors import APIError, field_name, invalid, unsupported

MAX_STOP_STRINGS = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
UINT32 = 2 ** 32  # bounds of the wire's integer fields (exclusive)
UINT64 = 2 ** 64

Int = Annotated[int, Strict()]  # a JSON integer: not true, "5" or 5.0
Float = Annotated[float, Strict()]  # a JSON number: not true or "0.5"
Bool = StrictBool  # JSON true or false only


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False


class _Sampling(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1, lt=UINT32)
    temperature: Float = Field(1.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int = Field(0, ge=-1, lt=UINT32)
    seed: Int | None = Field(None, ge=0, lt=UINT64)
    stop: list[str] = Field(default_factory=list)
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: Bool = False
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

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

    def check_supported(self) -> None:
        """Refuse what the server cannot do (raises APIError)."""
        if self.n != 1:
            raise unsupported("n", f"n = {self.n} (only n = 1)")
        if self.presence_penalty or self.frequency_penalty:
            name = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise unsupported(name, "a non-zero penalty")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "only allowed when stream is true")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: Any = None
    echo: Bool = False
    suffix: str | None = None
    logprobs: Int | None = None
    best_of: Int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, off in (("echo", False), ("suffix", None), ("logprobs", None)):
            if getattr(self, name) != off:
                raise unsupported(name, name)
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "best_of > 1")

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
        return self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
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
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise unsupported("logprobs", "logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise unsupported(name, "tool calling")
        if self.tool_choice not in (None, "none"):
            raise unsupported("tool_choice", "tool calling")
        if self.response_format and self.response_format.get("type") != "text":
            raise unsupported("response_format", "a structured response format")

    @property
    def output_limit(self) -> int | None:
        """None: the verifier's default."""
        return self.max_completion_tokens or self.max_tokens


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
    err = e.errors()[0]
    loc = [part for part in err["loc"] if part not in ("str", "list[ContentPart]")]
    param = field_name(loc)
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        message = "is required"
    return invalid(param, message, "missing" if err["type"] == "missing" else
                   "invalid_value")

"""Chat messages -> one prompt text.

A model directory with a chat template (`chat_template.jinja` or `tokenizer_config.json`,
see `Tokenizer.from_dir`) is rendered with jinja2 in a sandbox, with the variables
Hugging Face templates expect (`messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`). Without one, the documented default is used:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

one `<|role|>` line and the message per turn, then `<|assistant|>` and a newline.

A template is a program, so every Jinja render -- the server's and a request's own
`chat_template` (refused unless the gateway trusts them, vLLM's
`--trust-request-chat-template`) -- runs in a worker process (`render_pool.py`) within
`RenderLimits`: a time limit (the worker is killed past it), a cap on the text's size
(checked as it is produced, and before `*`/`+` build a large value) and on the worker's
memory. Every failure is a 400 naming whose template failed. This file is the one place
that knows how a template is rendered (`render_job`, `_compile`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chainspec.gateway.errors import APIError, invalid
from chainspec.gateway.logprobs import token_id_text
from chainspec.gateway.render_pool import RenderFailed, RenderPool, RenderTimeout
from chainspec.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


@dataclass(frozen=True)
class RenderLimits:
    """Bounds on one Jinja render."""

    timeout_s: float = 2.0  # then the worker is killed and the request is a 400
    max_chars: int = 16 * 2 ** 20  # prompt text (2x the largest body the gateway reads)
    memory_bytes: int = 2 ** 30  # data a worker may allocate beyond its own start
    workers: int = 2  # processes rendering at once; more renders wait for one


def default_render(turns: Sequence[Turn]) -> str:
    return "".join(f"<|{t.role}|>\n{t.content}\n" for t in turns) + "<|assistant|>\n"


class ChatTemplate:
    """Renders a conversation for generation (the assistant's turn comes next)."""

    def __init__(self, template: str | None = None, bos_token: str = "",
                 eos_token: str = "", tokenizer: Tokenizer | None = None,
                 limits: RenderLimits = RenderLimits()) -> None:
        self.tokenizer = tokenizer  # for logprobs' token strings; None: `token_id:<id>`
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.limits = limits
        if template:
            _compile(template, limits.max_chars)  # NOTE: a broken model template fails here
        self._pool: RenderPool | None = None  # started by the first Jinja render

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> ChatTemplate:
        """The model's template; the default when there is none (or no directory)."""
        if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
            return cls()
        tokenizer = Tokenizer.from_dir(model_dir)
        bos, eos = _special_tokens(Path(model_dir))
        return cls(tokenizer.chat_template, bos, eos, tokenizer)

    def token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return token_id_text(token)
        return self.tokenizer.decode([token], skip_special_tokens=False)

    @property
    def is_default(self) -> bool:
        return not self.source

    async def render(self, turns: Sequence[Turn], add_generation_prompt: bool = True,
                     continue_final: bool = False, variables: dict[str, Any] | None = None,
                     template: str | None = None, trust_template: bool = False) -> str:
        """The prompt text. `continue_final`: the text ends with the last message's
        content (its end-of-turn cut off) so the model continues it. `variables`
        (chat_template_kwargs) and `template` (a request's own chat_template, refused
        unless `trust_template`) need a Jinja template: the default one takes neither."""
        if template is not None and not trust_template:
            raise invalid("chat_template", "this server does not accept a request's chat "
                                           "template (start it with "
                                           "--trust-request-chat-template)")
        _check_variables(variables)
        source = self.source if template is None else template
        if not source:
            if variables:
                raise invalid("chat_template_kwargs", "the server's default chat template "
                                                      "takes no variables")
            text = default_render(turns)
            if not add_generation_prompt or continue_final:
                text = text.removesuffix("<|assistant|>\n")
        else:
            context = {**(variables or {}),
                       "messages": [{"role": t.role, "content": t.content} for t in turns],
                       "add_generation_prompt": add_generation_prompt and not continue_final,
                       "bos_token": self.bos_token, "eos_token": self.eos_token}
            text = await self._render_jinja(source, context, template is not None)
        return _cut_after(text, turns[-1].content) if continue_final else text

    async def _render_jinja(self, source: str, context: dict[str, Any], requested: bool) -> str:
        if self._pool is None:
            self._pool = RenderPool(render_job, self.limits.workers, self.limits.timeout_s,
                                    self.limits.memory_bytes)
        try:
            return await self._pool.call((source, context, self.limits.max_chars))
        except RenderTimeout:
            raise _failure(requested, f"did not finish within {self.limits.timeout_s:g} s "
                                      f"(stopped)") from None
        except RenderFailed as e:
            raise _failure(requested, _failure_text(e, self.limits)) from None

    def close(self) -> None:
        """Stop the render workers (a later render starts new ones)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


_RESERVED = frozenset({"messages", "bos_token", "eos_token", "add_generation_prompt"})


def _check_variables(variables: dict[str, Any] | None) -> None:
    if variables and "chat_template" in variables:  # HF's apply_chat_template argument
        raise invalid("chat_template_kwargs", "'chat_template' goes in the request's "
                                              "chat_template field")
    reserved = sorted(set(variables or ()) & _RESERVED)
    if reserved:
        raise invalid("chat_template_kwargs", f"{reserved[0]!r} is set by the server")


def _failure(requested: bool, what: str) -> APIError:
    """A 400 naming whose template failed: the request's (on `chat_template`) or the
    server's (on `messages`, what the client sent it)."""
    if requested:
        return invalid("chat_template", f"the request's chat template {what}")
    return invalid("messages", f"the server's chat template {what}")


def _failure_text(e: RenderFailed, limits: RenderLimits) -> str:
    if e.kind == "TemplateSyntaxError":
        return f"is not a valid Jinja template: {e.message}"
    if e.kind == "MemoryError":
        return f"needed more than {limits.memory_bytes // 2 ** 20} MiB of memory"
    if e.kind == "WorkerDied":
        return f"failed: {e.message}"
    return f"failed: {e.message or e.kind}"  # raise_exception's message among them


def _cut_after(text: str, content: str) -> str:
    """`text` up to the end of the last occurrence of `content` (Hugging Face's
    continue_final_message)."""
    at = text.rfind(content) if content else -1
    if at < 0:
        raise invalid("continue_final_message", "the chat template does not show the last "
                                                "message's content as given")
    return text[:at + len(content)]


# -- in the render worker ----------------------------------------------------------------
def render_job(job: tuple[str, dict[str, Any], int]) -> str:
    """(template source, variables, max_chars) -> the text; runs in a render worker."""
    source, context, max_chars = job
    return _joined(_compiled(source, max_chars).generate(**context), max_chars)


@functools.lru_cache(maxsize=16)
def _compiled(source: str, max_chars: int) -> jinja2.Template:
    return _compile(source, max_chars)


def _joined(chunks: Iterator[str], max_chars: int) -> str:
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > max_chars:
            raise TooLarge(f"its text passed the limit of {max_chars:,} characters")
        out.append(chunk)
    return "".join(out)


class TooLarge(jinja2.TemplateRuntimeError):
    pass


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `+` refusing to build a string or list over max_chars
    and `**` refusing integers over 64 Kibit (each would otherwise run long in one C call
    before any limit could look). `range` is the sandbox's own (100,000 at most)."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def __init__(self, max_chars: int, **options: Any) -> None:
        super().__init__(**options)
        self.max_chars = max_chars

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        if op == "**":
            _check_power(left, right)
        else:
            size = _result_size(op, left, right)
            if size > self.max_chars:
                raise TooLarge(f"{op!r} would build {size:,} items, over the limit of "
                               f"{self.max_chars:,}")
        return self.binop_table[op](left, right)


_SEQUENCES = (str, list, tuple)


def _result_size(op: str, left: Any, right: Any) -> int:
    if op == "+":
        both = isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES)
        return len(left) + len(right) if both else 0
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, _SEQUENCES) and isinstance(times, int):
            return len(seq) * max(times, 0)
    return 0


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 \
            and exponent * max(abs(base).bit_length() - 1, 1) > 65536:
        raise TooLarge("'**' would build an integer over 64 Kibit")


def _compile(template: str, max_chars: int) -> jinja2.Template:
    env = _BoundedEnvironment(max_chars, trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent,
                                                                  ensure_ascii=False)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _special_tokens(model_dir: Path) -> tuple[str, str]:
    path = model_dir / "tokenizer_config.json"
    try:
        cfg = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        cfg = {}

    def text(value) -> str:
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) else ""
    return text(cfg.get("bos_token")), text(cfg.get("eos_token"))

"""Chat messages -> one prompt text, as transformers' `apply_chat_template` renders it.

The template is the model's (`chat_template.jinja` or `tokenizer_config.json`, see
`Tokenizer.from_dir`), or `--chat-template` (vLLM's flag: a file, or the template text
itself), which replaces it. It sees what transformers gives it: `messages`, `tools` and
`documents` (None unless chat_template_kwargs set them), `add_generation_prompt`, the
named special tokens of `tokenizer_config.json` (`bos_token`, `eos_token`, ...) and the
request's chat_template_kwargs, in transformers' Jinja environment (`template_env.py`).
A model without a template has none: a chat request is a 400 naming `--chat-template`
(vLLM's answer too; nothing is invented).

A template is a program, so every Jinja render -- the server's and a request's own
`chat_template` (refused unless the gateway trusts them, vLLM's
`--trust-request-chat-template`) -- runs in a worker process (`render_pool.py`) within
`RenderLimits`: a time limit (the worker is killed past it), a cap on the text's size
(checked as it is produced, and before `*`/`+` build a large value) and on the worker's
memory. Every failure is a 400 naming whose template failed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from chainspec.gateway.errors import APIError, invalid
from chainspec.gateway.logprobs import token_id_text
from chainspec.gateway.render_pool import RenderFailed, RenderPool, RenderTimeout
from chainspec.gateway.template_env import compile_template, render_job
from chainspec.models.tokenizer import Tokenizer

# transformers' named special tokens (`special_tokens_map`), each a template variable
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' continue_final_message marker
NO_TEMPLATE = ("the model has no chat template (no chat_template.jinja, none in "
               "tokenizer_config.json): start the server with --chat-template (a file or "
               "the template itself), or send the prompt to /v1/completions")


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


def load_chat_template(value: str) -> str:
    """`--chat-template`: the text itself when it reads as a template (vLLM's rule: it
    holds `{`, `}` or a newline), else the file it names."""
    if any(c in value for c in "{}\n"):
        return value
    try:
        return Path(value).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"--chat-template {value}: neither a template nor a readable file "
                         f"({e.strerror})") from None


class ChatTemplate:
    """Renders a conversation for generation (the assistant's turn comes next)."""

    def __init__(self, template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None,
                 tokenizer: Tokenizer | None = None, limits: RenderLimits = RenderLimits(),
                 origin: str = "the chat template") -> None:
        self.tokenizer = tokenizer  # for logprobs' token strings; None: `token_id:<id>`
        self.source = template or None
        self.special_tokens = dict(special_tokens or {})
        self.limits = limits
        if self.source:
            try:  # NOTE: a broken model template fails at start, in one line
                compile_template(self.source, limits.max_chars)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"{origin} is not a valid Jinja template: line {e.lineno}: "
                                 f"{e.message}") from None
        self._pool: RenderPool | None = None  # started by the first Jinja render

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None, chat_template: str | None = None,
                       limits: RenderLimits = RenderLimits()) -> ChatTemplate:
        """The model's tokenizer, special tokens and template; `chat_template` (the
        `--chat-template` value) replaces the template. No directory: no tokenizer."""
        source = load_chat_template(chat_template) if chat_template else None
        origin = f"--chat-template {chat_template}" if chat_template else \
            f"the chat template of {model_dir}"
        if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
            return cls(source, limits=limits, origin=origin)
        tokenizer = Tokenizer.from_dir(model_dir)
        return cls(source or tokenizer.chat_template, _special_tokens(Path(model_dir)),
                   tokenizer, limits, origin)

    def token_text(self, token: int) -> str:
        if self.tokenizer is None:
            return token_id_text(token)
        return self.tokenizer.decode([token], skip_special_tokens=False)

    async def render(self, turns: Sequence[Turn], add_generation_prompt: bool = True,
                     continue_final: bool = False, variables: dict[str, Any] | None = None,
                     template: str | None = None, trust_template: bool = False) -> str:
        """The prompt text. `continue_final`: the text ends with the last message's
        content (its end-of-turn cut off) so the model continues it. `variables`
        (chat_template_kwargs; `tools` and `documents` among them) and `template` (a
        request's own chat_template, refused unless `trust_template`)."""
        if template is not None and not trust_template:
            raise invalid("chat_template", "this server does not accept a request's chat "
                                           "template (start it with "
                                           "--trust-request-chat-template)")
        _check_variables(variables)
        source = self.source if template is None else template
        if not source:
            raise invalid("messages", NO_TEMPLATE)
        messages = [{"role": t.role, "content": t.content} for t in turns]
        if continue_final:  # NOTE: transformers' way: mark the content, cut at the mark
            messages[-1]["content"] += CONTINUE_TAG
        variables = variables or {}
        context = {**self.special_tokens, **variables, "messages": messages,
                   "tools": variables.get("tools"), "documents": variables.get("documents"),
                   "add_generation_prompt": add_generation_prompt and not continue_final}
        text = await self._render_jinja(source, context, template is not None)
        return _cut_at_tag(text, turns[-1].content) if continue_final else text

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


_RESERVED = frozenset({"messages", "add_generation_prompt", *SPECIAL_TOKENS})


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


def _cut_at_tag(text: str, content: str) -> str:
    """`text` up to the continue mark, as transformers cuts it (trailing spaces a
    template trimmed after the content stay trimmed)."""
    tag = CONTINUE_TAG.strip()
    if tag not in text or content.strip() not in text:
        raise invalid("continue_final_message", "the chat template does not show the last "
                                                "message's content as given")
    at = text.rindex(tag)
    return text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """The named special tokens that `tokenizer_config.json` (else
    `special_tokens_map.json`) sets, as transformers passes them to a template."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        path = model_dir / name
        try:
            cfg = json.loads(path.read_text()) if path.is_file() else {}
        except json.JSONDecodeError:
            cfg = {}
        for key in SPECIAL_TOKENS if isinstance(cfg, dict) else ():
            value = cfg.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[key] = value
    return found

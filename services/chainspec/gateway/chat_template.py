"""Chat messages -> one prompt text.

A model directory with a chat template (`chat_template.jinja` or `tokenizer_config.json`,
see `Tokenizer.from_dir`) is rendered with jinja2 in a sandbox, with the variables
Hugging Face templates expect (`messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`). Without one, the documented default is used:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

one `<|role|>` line and the message per turn, then `<|assistant|>` and a newline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chainspec.gateway.errors import invalid
from chainspec.gateway.logprobs import token_id_text
from chainspec.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


def default_render(turns: Sequence[Turn]) -> str:
    return "".join(f"<|{t.role}|>\n{t.content}\n" for t in turns) + "<|assistant|>\n"


class ChatTemplate:
    """Renders a conversation for generation (the assistant's turn comes next)."""

    def __init__(self, template: str | None = None, bos_token: str = "",
                 eos_token: str = "", tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer  # for logprobs' token strings; None: `token_id:<id>`
        self.source = template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._compiled = _compile(template) if template else None

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
        return self._compiled is None

    def render(self, turns: Sequence[Turn], add_generation_prompt: bool = True,
               continue_final: bool = False, variables: dict[str, Any] | None = None,
               template: str | None = None) -> str:
        """The prompt text. `continue_final`: the text ends with the last message's
        content (its end-of-turn cut off) so the model continues it. `variables`
        (chat_template_kwargs) and `template` (a request's own chat_template) need a
        Jinja template: the default one takes neither."""
        compiled = self._compiled if template is None else _compile_request(template)
        if compiled is None:
            if variables:
                raise invalid("chat_template_kwargs", "the server's default chat template "
                                                      "takes no variables")
            text = default_render(turns)
            if not add_generation_prompt or continue_final:
                text = text.removesuffix("<|assistant|>\n")
            return _cut_after(text, turns[-1].content) if continue_final else text
        if continue_final:
            add_generation_prompt = False
        reserved = sorted(set(variables or ()) & _RESERVED)
        if reserved:
            raise invalid("chat_template_kwargs", f"{reserved[0]!r} is set by the server")
        try:
            text = compiled.render(
                **(variables or {}),
                messages=[{"role": t.role, "content": t.content} for t in turns],
                add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                eos_token=self.eos_token)
        except jinja2.TemplateError as e:  # incl. raise_exception from the template
            raise invalid("messages", f"the model's chat template refused them: {e}") from None
        return _cut_after(text, turns[-1].content) if continue_final else text


_RESERVED = frozenset({"messages", "bos_token", "eos_token", "add_generation_prompt"})


def _cut_after(text: str, content: str) -> str:
    """`text` up to the end of the last occurrence of `content` (Hugging Face's
    continue_final_message)."""
    at = text.rfind(content) if content else -1
    if at < 0:
        raise invalid("continue_final_message", "the chat template does not show the last "
                                                "message's content as given")
    return text[:at + len(content)]


def _compile_request(template: str) -> jinja2.Template:
    try:
        return _compile(template)
    except jinja2.TemplateError as e:
        raise invalid("chat_template", f"not a valid Jinja template: {e}") from None


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
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

"""The tokenizer of a model directory: a thin wrapper over `tokenizers.Tokenizer`.

End-of-sequence ids are the union, in this order, of `generation_config.json`'s and
`config.json`'s `eos_token_id` and `tokenizer_config.json`'s `eos_token`. The chat
template comes from `chat_template.jinja` if present, else `tokenizer_config.json`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from chainspec.models.errors import CheckpointError


@dataclass(frozen=True)
class Tokenizer:
    backend: Backend
    eos_token_ids: tuple[int, ...]
    chat_template: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer.json not found")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception
            raise CheckpointError(f"{path}: cannot read tokenizer ({e})") from e
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        return cls(backend, _eos_ids(model_dir, backend, tok_cfg),
                   _chat_template(model_dir, tok_cfg))

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: the backend's single `encode` holds the GIL throughout (a 10 MB prompt froze
        # a server's event loop for seconds even from a worker thread); `encode_batch`
        # releases it and gives the same ids.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @property
    def max_token_chars(self) -> int:
        """Characters in the longest vocabulary entry (bounds the text a context holds)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def _read_json(path: Path) -> dict[str, Any]:
    """A side config as a dict; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _eos_ids(model_dir: Path, backend: Backend, tok_cfg: dict[str, Any]) -> tuple[int, ...]:
    ids = _as_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
    ids += _as_ids(_read_json(model_dir / "config.json").get("eos_token_id"))
    token = tok_cfg.get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None and backend.token_to_id(token) is not None:
        ids.append(backend.token_to_id(token))
    return tuple(dict.fromkeys(ids))


def _chat_template(model_dir: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates; "default" is the chat one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template

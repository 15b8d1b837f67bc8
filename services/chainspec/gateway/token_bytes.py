"""A token's own bytes, for logprobs' `bytes` field (OpenAI: "the UTF-8 bytes of the
token", which for a byte-level vocabulary is a piece of a character, not always valid
UTF-8 alone). Read from the vocabulary entry by the decoder's kind:

- ByteLevel (GPT-2, Llama-3, Qwen): each character of the entry maps back to one byte;
- ByteFallback (SentencePiece `<0xHH>` pieces): the byte HH;
- Metaspace, or Llama-2's Replace("▁", " ") (SentencePiece): the entry with its `▁` as
  a space (the first token's space too, which a decode of the token alone strips);
- anything else, and added tokens: the UTF-8 of the token's decoded text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from chainspec.models.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable bytes stand for themselves, the rest
    are shifted past 255 in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    codes, shifted = {b: b for b in kept}, 0
    for b in range(256):
        if b not in codes:
            codes[b], shifted = 256 + shifted, shifted + 1
    return {chr(c): b for b, c in codes.items()}


def _decoder_kinds(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    kinds = {decoder.get("type", "")}
    for inner in decoder.get("decoders") or []:
        kinds |= _decoder_kinds(inner)
    return kinds


class TokenBytes:
    """`token_bytes(id)`: the token's bytes, per the module docstring."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        spec = json.loads(tokenizer.backend.to_str())
        self.kinds = _decoder_kinds(spec.get("decoder"))
        self.added = {t["id"] for t in spec.get("added_tokens") or []}
        self._byte_level = byte_level_decoder() if "ByteLevel" in self.kinds else None

    def __call__(self, token: int) -> bytes:
        piece = self.tokenizer.backend.id_to_token(token)
        if piece is None or token in self.added:
            return self._text(token)
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        match = _BYTE_PIECE.match(piece)
        if match and "ByteFallback" in self.kinds:
            return bytes([int(match.group(1), 16)])
        if self.kinds & {"Metaspace", "Replace"}:  # Llama-2's decoder: Replace("▁", " ")
            return piece.replace("\u2581", " ").encode("utf-8")
        return self._text(token)

    def _text(self, token: int) -> bytes:
        return self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")


def token_bytes_of(tokenizer: Tokenizer | None, text: Callable[[int], str]
                   ) -> Callable[[int], bytes]:
    """The tokenizer's `TokenBytes`, or the UTF-8 of `text` without a tokenizer."""
    if tokenizer is None:
        return lambda token: text(token).encode("utf-8")
    return TokenBytes(tokenizer)

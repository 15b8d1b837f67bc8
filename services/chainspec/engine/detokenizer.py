"""Incremental detokenization for streaming: text deltas that never split a multi-byte
character and never show a possible stop string before it is ruled out."""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what byte-level decoders produce for an incomplete character


class IncrementalDetokenizer:
    """`add(tokens) -> delta` while streaming, `finish(tokens, stop_string) -> last delta`.

    Decoding looks back from `prefix` (tokens whose text is already final) so that
    tokenizers whose text depends on the previous token (leading spaces) decode as a
    whole; text ending in an incomplete character waits for the next token.
    """

    def __init__(self, decode: Callable[[list[int]], str],
                 stop_strings: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stop_strings = tuple(stop_strings)
        self.tokens: list[int] = []
        self.prefix = 0  # tokens[prefix:read] decode to the context of the next delta
        self.read = 0  # tokens[:read] are part of `text`
        self.text = ""  # decoded so far (complete characters only)
        self.sent = 0  # characters of `text` already returned

    def add(self, tokens: Sequence[int]) -> str:
        self.tokens.extend(tokens)
        before = self.decode(self.tokens[self.prefix:self.read])
        after = self.decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        return self._take(self._holdback())

    def finish(self, tokens: Sequence[int] = (), stop_string: str | None = None,
               include_stop: bool = False) -> str:
        """The rest of the text after the last `tokens`; with `stop_string`, only the
        text before its first match (`include_stop`: up to the match's end)."""
        self.tokens.extend(tokens)
        before = self.decode(self.tokens[self.prefix:self.read])
        self.text += self.decode(self.tokens[self.prefix:])[len(before):]
        self.prefix = self.read = len(self.tokens)
        end = len(self.text)
        if stop_string:
            at = self.text.find(stop_string, self.sent)
            end = (at + len(stop_string) * include_stop) if at >= 0 else end
        return self._take(len(self.text) - max(end, self.sent))

    def _holdback(self) -> int:
        """Characters at the end of `text` that could begin a stop string."""
        longest = 0
        for s in self.stop_strings:
            for n in range(min(len(s), len(self.text) - self.sent), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _take(self, hold: int) -> str:
        end = len(self.text) - hold
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

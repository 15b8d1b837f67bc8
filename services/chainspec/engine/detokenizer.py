"""Incremental detokenization for streaming, on `tokenizers`' `DecodeStream`: text deltas
that never split a multi-byte character, that read as the prompt's continuation, and that
never show a possible stop string before it is ruled out.

The stream is seeded with the prompt's last few ids, so a decoder whose text depends on
the previous token sees the first output token in context: a Metaspace (SentencePiece)
tokenizer keeps the leading space of " Paris", a WordPiece one puts the space between
words. What streams is then `decode(prompt + output)` minus `decode(prompt)`. Each token
costs one decode of the ids since the last text (the stream drops older ones), never of a
growing tail.

NOTE: every tokenizer here is a fast one (`tokenizer.json`, `models/tokenizer.py`); there
is no slow-tokenizer path to fall back for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer as Backend
from tokenizers.decoders import DecodeStream

STOP_TAIL, STOP_CONTEXT = 32, 4  # output ids a stop-string check reads; ids before them
REPLACEMENT = "\ufffd"  # what byte-level decoders produce for an incomplete character
SEED_MIN, SEED_MAX = 4, 24  # prompt ids the stream starts from (a clean decode's worth)


class IncrementalDetokenizer:
    """`add(tokens) -> delta` while streaming, `finish(tokens, stop_string) -> last delta`.

    `prompt`: the ids the output continues (only the last few are read).
    """

    def __init__(self, backend: Backend, prompt: Sequence[int] = (),
                 stop_strings: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.backend, self.skip_special_tokens = backend, skip_special_tokens
        self.stop_strings = tuple(stop_strings)
        seed = prompt_seed(backend, prompt, skip_special_tokens)
        self._stream = DecodeStream(seed, skip_special_tokens)
        self._context = seed  # the ids the stream's next text follows
        self._pending: list[int] = []  # ids stepped since the stream last gave text
        self.held = ""  # text decoded but not returned yet (a possible stop string's start)

    def add(self, tokens: Sequence[int]) -> str:
        for token in tokens:
            self._step(token)
        hold = self._holdback()
        delta, self.held = self.held[:len(self.held) - hold], self.held[len(self.held) - hold:]
        return delta

    def finish(self, tokens: Sequence[int] = (), stop_string: str | None = None,
               include_stop: bool = False) -> str:
        """The rest of the text after the last `tokens` (an incomplete character as the
        decoder renders it); with `stop_string`, only the text before its first match
        (`include_stop`: up to the match's end)."""
        for token in tokens:
            self._step(token)
        if self._pending:  # NOTE: the stream keeps bytes of an unfinished character
            base = self._decode(self._context)
            self.held += self._decode(self._context + self._pending)[len(base):]
            self._context, self._pending = self._context + self._pending, []
        end = len(self.held)
        if stop_string:
            at = self.held.find(stop_string)
            end = (at + len(stop_string) * include_stop) if at >= 0 else end
        delta, self.held = self.held[:end], ""
        return delta

    def _step(self, token: int) -> None:
        self._pending.append(token)
        chunk = self._stream.step(self.backend, token)
        if chunk is not None:  # the stream now decodes after exactly these ids
            self.held += chunk
            self._context, self._pending = self._pending, []

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _holdback(self) -> int:
        """Characters at the end of `held` that could begin a stop string."""
        longest = 0
        for s in self.stop_strings:
            for n in range(min(len(s), len(self.held)), longest, -1):
                if self.held.endswith(s[:n]):
                    longest = n
                    break
        return longest


def prompt_seed(backend: Backend, prompt: Sequence[int], skip_special_tokens: bool
                ) -> list[int]:
    """The shortest suffix of `prompt` (SEED_MIN ids or more, SEED_MAX at most) that
    decodes to whole characters; [] when none does (a prompt cut inside a character).
    NOTE: a seed ending inside a character would make the stream repeat its text."""
    tail = list(prompt[-SEED_MAX:])
    for n in range(min(SEED_MIN, len(tail)), len(tail) + 1):
        seed = tail[len(tail) - n:]
        if REPLACEMENT not in backend.decode(seed, skip_special_tokens=skip_special_tokens):
            return seed
    return []


def stop_tail(detokenize: Callable[[list[int]], str], tokens: Sequence[int],
              num_output: int) -> str:
    """The text of the last `STOP_TAIL` output ids of `tokens` (prompt + output, the last
    `num_output` of them output) as the continuation of the `STOP_CONTEXT` ids before
    them, as the stream renders it: a Metaspace first token keeps its leading space, so a
    stop string " Paris" matches there too. Falls back to the ids alone where the
    context's text is not a prefix (a character cut at the seam)."""
    start = len(tokens) - min(num_output, STOP_TAIL)
    ids = list(tokens[start:])
    context = list(tokens[max(0, start - STOP_CONTEXT):start])
    if not context:
        return detokenize(ids)
    before, whole = detokenize(context), detokenize(context + ids)
    return whole[len(before):] if whole.startswith(before) else detokenize(ids)

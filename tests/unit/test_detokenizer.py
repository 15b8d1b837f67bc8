"""Incremental detokenization: deltas add up to the full text, multi-byte characters are
never split, stop strings are held back and cut."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from chainspec.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer without merges: every UTF-8 byte is one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


TEXT = "a € 你好 🙂 end"


def test_deltas_never_split_characters(byte_tokenizer) -> None:
    ids = byte_tokenizer.encode(TEXT).ids
    assert len(ids) > len(TEXT)  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(byte_tokenizer.decode)
    deltas = [detok.add([t]) for t in ids]
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) + detok.finish() == TEXT
    assert "" in deltas  # some tokens complete no character


def test_stop_string_is_held_back_and_cut(byte_tokenizer) -> None:
    ids = byte_tokenizer.encode("hello STOP world").ids
    detok = IncrementalDetokenizer(byte_tokenizer.decode, ["STOP"])
    streamed = ""
    end = len(byte_tokenizer.encode("hello STOP").ids)
    for t in ids[:end - 1]:
        streamed += detok.add([t])
        assert "S" not in streamed  # a possible prefix is never shown
    streamed += detok.finish(ids[end - 1:end], stop_string="STOP")  # as the engine stops
    assert streamed == "hello "


def test_finish_flushes_an_incomplete_tail(byte_tokenizer) -> None:
    ids = byte_tokenizer.encode("x€").ids
    detok = IncrementalDetokenizer(byte_tokenizer.decode)
    assert detok.add(ids[:1]) == "x"
    assert detok.add(ids[1:-1]) == ""  # '€' is incomplete
    assert detok.finish() == byte_tokenizer.decode(ids[1:-1])  # the bytes as they are


def test_held_prefix_is_released_when_ruled_out(byte_tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer.decode, ["abc"])
    assert detok.add(byte_tokenizer.encode("xab").ids) == "x"
    assert detok.add(byte_tokenizer.encode("d").ids) == "abd"

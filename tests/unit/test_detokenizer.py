"""Incremental detokenization against transformers: what streams for a prompt's output is
`decode(prompt + output)` minus `decode(prompt)` for Metaspace, ByteLevel and WordPiece
decoders (the first token included), multi-byte characters are never split, stop strings
are held back and cut, and each token decodes a bounded window."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from chainspec.engine.detokenizer import (
    REPLACEMENT,
    SEED_MAX,
    STOP_TAIL,
    IncrementalDetokenizer,
    prompt_seed,
    stop_tail,
)

CORPUS = ["The capital of France is Paris.", "Grüße aus Köln, 你好世界 🙂 naïve café",
          "hello world, STOP here. Paris is the capital."] * 10
PROMPT = "The capital of France is"
# "€" and "ж" are not in CORPUS: Metaspace spells them in byte-fallback tokens, ByteLevel
# in single bytes -- characters that take several tokens
OUTPUT = " Paris. Grüße € 你好 🙂 ж STOP here."


def _metaspace() -> Tokenizer:  # Llama-2 / Mistral v0.x style (SentencePiece BPE)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]  # the byte tokens <0x00>..<0xFF> are vocabulary, as in Llama's
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def _byte_level() -> Tokenizer:  # GPT-2 / Llama-3 / Qwen style
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=340, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _word_piece() -> Tokenizer:  # BERT style: "##" continuations, spaces between words
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "</s>"]))
    return tok


@pytest.fixture(scope="module", params=["metaspace", "byte_level", "word_piece"])
def tokenizers_pair(request):
    """(backend, transformers' PreTrainedTokenizerFast over it): the oracle's decode."""
    from transformers import PreTrainedTokenizerFast
    backend = {"metaspace": _metaspace, "byte_level": _byte_level,
               "word_piece": _word_piece}[request.param]()
    return backend, PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>",
                                            clean_up_tokenization_spaces=False)


def _ids(backend: Tokenizer, text: str) -> list[int]:
    return backend.encode(text, add_special_tokens=False).ids


def _expected(hf, prompt: list[int], output: list[int]) -> str:
    """transformers' text of the output as the prompt's continuation."""
    before = hf.decode(prompt, skip_special_tokens=True)
    whole = hf.decode(prompt + output, skip_special_tokens=True)
    assert whole.startswith(before)
    return whole[len(before):]


def _rounds(tokens: list[int], seed: int) -> list[list[int]]:
    """`tokens` in commits of 1..4 (speculative rounds commit several at once)."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(tokens):
        n = rng.randint(1, 4)
        out.append(tokens[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("rounds_seed", [None, 0, 1])
def test_stream_equals_transformers_decode(tokenizers_pair, rounds_seed) -> None:
    backend, hf = tokenizers_pair
    prompt, output = _ids(backend, PROMPT), _ids(backend, OUTPUT)
    eos = backend.token_to_id("</s>")
    output = output + [eos]  # a special token: skipped, as transformers skips it
    detok = IncrementalDetokenizer(backend, prompt)
    rounds = [[t] for t in output] if rounds_seed is None else _rounds(output, rounds_seed)
    deltas = [detok.add(r) for r in rounds]
    streamed = "".join(deltas) + detok.finish()
    assert streamed == _expected(hf, prompt, output)
    assert all(REPLACEMENT not in d for d in deltas)  # no character split between deltas
    unk = backend.token_to_id("[UNK]")  # WordPiece's: it knows neither character
    assert all(c in streamed for c in "€ж" if unk not in _ids(backend, c))


def test_the_first_token_keeps_its_leading_space_with_metaspace() -> None:
    """Llama-2's "Paris" bug: decoded alone, a SentencePiece first token loses its space."""
    backend = _metaspace()
    prompt, output = _ids(backend, PROMPT), _ids(backend, " Paris.")
    assert backend.decode(output) == "Paris."  # what an unseeded stream shows
    detok = IncrementalDetokenizer(backend, prompt)
    first = detok.add(output[:1])
    assert first.startswith(" P")
    assert first + detok.finish(output[1:]) == " Paris."


def test_word_piece_spaces_the_first_word_from_the_prompt() -> None:
    backend = _word_piece()
    prompt, output = _ids(backend, PROMPT), _ids(backend, "Paris")
    assert backend.decode(output) == "Paris"
    detok = IncrementalDetokenizer(backend, prompt)
    assert detok.add(output) + detok.finish() == " Paris"


def test_stop_string_is_held_back_and_cut(tokenizers_pair) -> None:
    """Streamed as the engine streams: tokens until the decoded output shows the stop
    string, then finish with it. A possible start of it is never shown."""
    backend, hf = tokenizers_pair
    prompt, output = _ids(backend, PROMPT), _ids(backend, OUTPUT)
    stop = "STOP"
    detok, streamed = IncrementalDetokenizer(backend, prompt, [stop, "Zq"]), ""
    for i, token in enumerate(output):
        if stop in _expected(hf, prompt, output[:i + 1]):  # the engine's stop
            streamed += detok.finish([token], stop_string=stop)
            break
        streamed += detok.add([token])
        assert not streamed.endswith(("S", "ST", "STO"))
    full = _expected(hf, prompt, output)
    assert streamed == full[:full.index(stop)]


@pytest.mark.parametrize("include,want", [(False, " hello "), (True, " hello STOP")])
def test_include_stop_keeps_the_stop_string(include, want) -> None:
    backend = _byte_level()
    output = _ids(backend, " hello STOP")
    detok = IncrementalDetokenizer(backend, _ids(backend, PROMPT), ["STOP"])
    text = detok.add(output[:-1]) + detok.finish(output[-1:], "STOP", include)
    assert text == want


def test_finish_flushes_an_incomplete_tail() -> None:
    backend = _byte_level()
    ids = _ids(backend, " x€")
    assert len(ids) >= 3  # "€" is three byte tokens here
    detok = IncrementalDetokenizer(backend, _ids(backend, PROMPT))
    assert detok.add(ids[:-2]) == " x"
    assert detok.add(ids[-2:-1]) == ""  # '€' is incomplete
    assert detok.finish() == backend.decode(ids[-2:-1])  # the bytes as they are


def test_held_prefix_is_released_when_ruled_out() -> None:
    backend = _byte_level()
    detok = IncrementalDetokenizer(backend, (), ["abc"])
    assert detok.add(_ids(backend, "xab")) == "x"
    assert detok.add(_ids(backend, "d")) == "abd"


def test_each_token_decodes_a_bounded_window() -> None:
    """O(1) per token: the ids the stream re-decodes never grow with the output, and a
    long prompt is read only at its end."""
    backend = _byte_level()
    prompt = _ids(backend, PROMPT * 200)
    seed = prompt_seed(backend, prompt, True)
    assert 0 < len(seed) <= SEED_MAX and seed == prompt[-len(seed):]
    detok = IncrementalDetokenizer(backend, prompt)
    output = _ids(backend, OUTPUT * 50)
    for token in output:
        detok.add([token])
        assert len(detok._context) + len(detok._pending) <= 8  # NOTE: one character's bytes
    assert detok.finish() == "" and detok.held == ""


def test_seed_skips_a_prompt_cut_inside_a_character() -> None:
    backend = _byte_level()
    ids = _ids(backend, "ok €")
    cut = ids[:-1]  # the prompt ends inside '€'
    assert prompt_seed(backend, cut, True) == []
    assert REPLACEMENT not in backend.decode(prompt_seed(backend, ids, True))


def test_stop_tail_reads_the_first_token_in_context(tokenizers_pair) -> None:
    """The engine's stop-string check sees what the stream shows: with Metaspace, the
    first output token's leading space (" Paris" after the prompt), which decoding the
    output ids alone drops; later, the last STOP_TAIL ids as the text's continuation."""
    backend, hf = tokenizers_pair
    prompt, output = _ids(backend, PROMPT), _ids(backend, OUTPUT)
    decode = lambda ids: backend.decode(ids)  # noqa: E731  (the engine's detokenize)
    first = stop_tail(decode, prompt + output[:1], 1)
    assert first == _expected(hf, prompt, output[:1])
    tokens = prompt + output
    tail = stop_tail(decode, tokens, len(output))
    assert _expected(hf, prompt, output).endswith(tail)
    assert len(tail) >= len(backend.decode(output[-STOP_TAIL:])) - 1


def test_stop_tail_without_context_is_the_ids_text() -> None:
    backend = _metaspace()
    output = _ids(backend, OUTPUT)
    assert stop_tail(backend.decode, output, len(output)) == backend.decode(
        output[-STOP_TAIL:])

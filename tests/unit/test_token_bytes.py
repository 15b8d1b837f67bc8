"""Logprobs' `bytes` are the token's own bytes: concatenated over a text's tokens they are
the text's UTF-8, even where a character spans tokens (a byte-level piece alone, or a
SentencePiece `<0xHH>` byte, decodes to U+FFFD, whose UTF-8 is not the byte)."""

from __future__ import annotations

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers

from chainspec.gateway.logprobs import chat_logprobs
from chainspec.gateway.token_bytes import TokenBytes, byte_level_decoder
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.integration.tiny_checkpoint import write_tokenizer

TEXT = "Ünïcödé: €, 你好, 🙂 fox"


def test_byte_level_decoder_is_a_bijection_onto_bytes() -> None:
    table = byte_level_decoder()
    assert sorted(table.values()) == list(range(256)) and len(table) == 256
    assert table["Ġ"] == ord(" ") and table["!"] == ord("!") and table["Ċ"] == ord("\n")


def test_byte_level_tokens_concatenate_to_the_texts_bytes(tmp_path) -> None:
    write_tokenizer(tmp_path, 300)
    tok = Tokenizer.from_dir(tmp_path)
    raw, ids = TokenBytes(tok), tok.encode(TEXT)
    assert b"".join(raw(i) for i in ids) == TEXT.encode("utf-8")
    # the property is not vacuous: some token is part of a character
    assert any(raw(i) != tok.decode([i], skip_special_tokens=False).encode() for i in ids)


def llama2_style(tmp_path) -> Tokenizer:
    """Llama-2's pipeline: Prepend/Replace normalizer, BPE with byte fallback, and a
    Replace/ByteFallback/Fuse/Strip decoder; the vocabulary lacks every non-ASCII char."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["\u2581", "f", "o", "x", ":", ",", "\u2581f", "\u2581fo", "\u2581fox"]:
        vocab[piece] = len(vocab)
    backend = Backend(models.BPE(vocab, [("\u2581", "f"), ("\u2581f", "o"), ("\u2581fo", "x")],
                                 unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer.from_dir(tmp_path)


def test_sentencepiece_byte_fallback_and_leading_space(tmp_path) -> None:
    tok = llama2_style(tmp_path)
    raw, ids = TokenBytes(tok), tok.encode(TEXT)
    assert tok.decode(ids) == TEXT  # the tokenizer itself round-trips
    assert b"".join(raw(i) for i in ids) == (" " + TEXT).encode("utf-8")  # "▁" prepended
    fox = tok.token_id("\u2581fox")
    assert raw(fox) == b" fox" and tok.decode([fox]) == "fox"  # decode alone strips it


def test_chat_logprobs_use_the_raw_bytes(tmp_path) -> None:
    write_tokenizer(tmp_path, 300)
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("你")
    lps = [pb.TokenLogprob(token_id=i, logprob=-0.5,
                           top_logprobs=[pb.TopLogprob(token_id=i, logprob=-0.5)])
           for i in ids]
    content = chat_logprobs(lps, lambda t: tok.decode([t]), TokenBytes(tok))["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == "你".encode()
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]

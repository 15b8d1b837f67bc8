"""Corpus -> tokenizer -> token streams: everything the stages and the evaluation read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from chainspec.training.bpe import encode_documents, eot_id, token_stream, train_tokenizer
from chainspec.training.corpus import CorpusSplit, load_split
from chainspec.training.recipe import Recipe


@dataclass(frozen=True)
class PreparedData:
    split: CorpusSplit
    tokenizer: Tokenizer
    eot: int
    train_stream: torch.Tensor  # [N_train] int64
    held_out_docs: tuple[list[int], ...]
    held_out_stream: torch.Tensor  # [N_held] int64

    def stats(self) -> dict[str, int]:
        return {
            "train_files": len(self.split.train),
            "held_out_files": len(self.split.held_out),
            "train_chars": self.split.chars("train"),
            "held_out_chars": self.split.chars("held_out"),
            "train_tokens": int(self.train_stream.numel()),
            "held_out_tokens": int(self.held_out_stream.numel()),
        }


def prepare(recipe: Recipe, root: Path | None = None) -> PreparedData:
    d = recipe.data
    split = load_split(root, d.held_out_percent, d.max_file_bytes, d.max_files)
    if not split.train or not split.held_out:
        raise ValueError(f"split has {len(split.train)} train and {len(split.held_out)} "
                         "held-out files; need both")
    # NOTE: the tokenizer sees training files only, so held-out text is truly unseen.
    tok = train_tokenizer((f.text for f in split.train), recipe.shape.vocab_size)
    if tok.get_vocab_size() != recipe.shape.vocab_size:
        raise ValueError(f"BPE reached {tok.get_vocab_size()} tokens, not "
                         f"{recipe.shape.vocab_size}: corpus too small for the vocabulary")
    eot = eot_id(tok)
    train = encode_documents(tok, [f.text for f in split.train])
    held = encode_documents(tok, [f.text for f in split.held_out])
    return PreparedData(split, tok, eot, token_stream(train, eot), tuple(held),
                        token_stream(held, eot))

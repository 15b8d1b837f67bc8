"""The corpus as token streams in the target's own tokenizer: documents joined by the
separator `SEP doc SEP doc ...` (SEP: the target's BOS, else its first EOS)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chainspec.models.target import TargetModel
from chainspec.models.tokenizer import Tokenizer
from chainspec.training.bpe import token_stream
from chainspec.training.self_continue import continue_prompts
from chainspec.training.text_corpus import TextCorpus


@dataclass(frozen=True)
class TokenData:
    sep: int
    eos: tuple[int, ...]
    train_stream: torch.Tensor  # [N_train] int64
    held_out_docs: tuple[list[int], ...]
    held_out_stream: torch.Tensor  # [N_held] int64
    stats: dict[str, int]


def separator(target: TargetModel, tok: Tokenizer) -> int:
    cfg = target.config
    eos = cfg.eos_token_ids or tok.eos_token_ids
    if cfg.bos_token_id is None and not eos:
        raise ValueError("the target declares neither a BOS nor an EOS token")
    return cfg.bos_token_id if cfg.bos_token_id is not None else eos[0]


def tokenize(corpus: TextCorpus, tok: Tokenizer, target: TargetModel,
             continue_tokens: int, seed: int) -> TokenData:
    sep = separator(target, tok)
    eos = target.config.eos_token_ids or tok.eos_token_ids or (sep,)
    split, prompts = corpus.documents, corpus.prompts
    train = [_encode(tok, f.text) for f in split.train]
    held = [_encode(tok, f.text) for f in split.held_out]
    for docs, files, salt in ((train, prompts.train, 0), (held, prompts.held_out, 1)):
        heads = [[sep] + _encode(tok, f.text) for f in files]  # the target reads SEP first
        docs += [c[1:] for c in continue_prompts(target, heads, continue_tokens, eos,
                                                  seed + salt)]
    if not train or not held:
        raise ValueError(f"the corpus has {len(train)} train and {len(held)} held-out "
                         "documents; need both (more documents, or a larger "
                         "--held-out-percent)")
    train_stream, held_stream = token_stream(train, sep), token_stream(held, sep)
    stats = {"train_docs": len(train), "held_out_docs": len(held),
             "prompts_continued": len(prompts.train) + len(prompts.held_out),
             "train_chars": split.chars("train"), "held_out_chars": split.chars("held_out"),
             "train_tokens": int(train_stream.numel()),
             "held_out_tokens": int(held_stream.numel())}
    return TokenData(sep, tuple(eos), train_stream, tuple(held), held_stream, stats)


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)

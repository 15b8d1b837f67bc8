"""The demo tokenizer: byte-level BPE trained on the training split.

`<|endoftext|>` (id 0) separates files; it is the model's BOS and EOS.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE (no unknown tokens; any text round-trips)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def eot_id(tok: Tokenizer) -> int:
    index = tok.token_to_id(EOT)
    if index is None:
        raise ValueError(f"tokenizer has no {EOT} token")
    return index


def encode_documents(tok: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    return [enc.ids for enc in tok.encode_batch(list(texts))]


def token_stream(docs: Sequence[Sequence[int]], eot: int) -> torch.Tensor:
    """Documents joined as `EOT doc EOT doc ...` -> [N] int64."""
    ids: list[int] = []
    for doc in docs:
        ids.append(eot)
        ids.extend(doc)
    return torch.tensor(ids, dtype=torch.int64)


# The demo's chat format: a `<|role|>` line and the message per turn, then `<|assistant|>`
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + "
                 "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
                 "{% endif %}")


def write_tokenizer_files(tok: Tokenizer, out_dir: Path, max_length: int) -> None:
    """tokenizer.json plus a tokenizer_config.json that transformers understands."""
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

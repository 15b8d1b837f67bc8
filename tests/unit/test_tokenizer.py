"""The tokenizer wrapper: round trip, vocab size, EOS ids from every source, chat template."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from chainspec.models.errors import CheckpointError
from chainspec.models.tokenizer import Tokenizer

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "the", "<|im_end|>"]


def write_tokenizer(path) -> None:
    backend = Backend(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True)
                                for t in ("<s>", "</s>", "<|im_end|>")])
    backend.save(str(path / "tokenizer.json"))


def write_json(path, name, data) -> None:
    (path / name).write_text(json.dumps(data))


def test_round_trip_and_vocab(tmp_path):
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("hello the world")
    assert ids == [3, 5, 4]
    assert tok.decode(ids + [2]) == "hello the world"  # special </s> skipped
    assert tok.decode([2], skip_special_tokens=False) == "</s>"
    assert tok.vocab_size == len(WORDS)
    assert tok.token_id("<|im_end|>") == 6


def test_eos_ids_merge_generation_config_config_and_tokenizer_config(tmp_path):
    write_tokenizer(tmp_path)
    write_json(tmp_path, "generation_config.json", {"eos_token_id": [6, 2]})
    write_json(tmp_path, "config.json", {"eos_token_id": 2})
    write_json(tmp_path, "tokenizer_config.json",
               {"eos_token": {"content": "<unk>"}, "chat_template": "{{ x }}"})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (6, 2, 0)  # ordered by source, no duplicates
    assert tok.chat_template == "{{ x }}"


def test_eos_from_tokenizer_config_alone_and_no_template(tmp_path):
    write_tokenizer(tmp_path)
    write_json(tmp_path, "tokenizer_config.json", {"eos_token": "</s>"})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (2,)
    assert tok.chat_template is None


def test_chat_template_file_wins_and_named_templates(tmp_path):
    write_tokenizer(tmp_path)
    write_json(tmp_path, "tokenizer_config.json", {"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    assert Tokenizer.from_dir(tmp_path).chat_template == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(tmp_path).chat_template == "J"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json not found"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_side_config_names_the_file(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"generation_config\.json: invalid JSON"):
        Tokenizer.from_dir(tmp_path)

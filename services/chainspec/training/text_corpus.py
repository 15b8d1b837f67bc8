"""The corpus `chainspec train-mtp --data SPEC` reads, split into train and held-out.

SPEC is one of:
- `stdlib`: the demo corpus (this interpreter's standard-library sources, `corpus.py`);
- a directory: every text file under it (by suffix, `TEXT_SUFFIXES`), one document each;
- a `.jsonl` file: one record per line, `{"text": ...}` (a document) or `{"prompt": ...}`
  (a prompt the frozen target continues itself, `self_continue.py`);
- any other file: plain text, documents separated by blank lines.

The split is by document, deterministic: a document is held out when
`sha256(key) mod 100 < held_out_percent`, its key being its relative path (stdlib,
directory) or `name:index` (records, paragraphs).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from chainspec.training.corpus import CorpusFile, CorpusSplit, is_held_out, load_split

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".json", ".c", ".h", ".js", ".ts",
                           ".go", ".rs", ".java", ".html", ".css", ".sh", ".yaml", ".toml"})
_PARAGRAPH = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class TextCorpus:
    documents: CorpusSplit  # text to train on / to evaluate on
    prompts: CorpusSplit  # prompts the target continues (empty unless JSONL has them)


def check_spec(spec: str) -> None:
    """ValueError unless SPEC names a corpus `read_corpus` can read (cheap: reads nothing)."""
    path = Path(spec)
    if spec != "stdlib" and not path.is_dir() and not path.is_file():
        raise ValueError(f"--data {spec}: not 'stdlib', a directory or a file")
    if path.is_file() and not os.access(path, os.R_OK):
        raise ValueError(f"--data {spec}: cannot read it")


def read_corpus(spec: str, held_out_percent: int) -> TextCorpus:
    check_spec(spec)
    if spec == "stdlib":
        return TextCorpus(load_split(held_out_percent=held_out_percent), _split("", [], 1))
    path = Path(spec)
    if path.is_dir():
        docs = [(p.relative_to(path).as_posix(), p.read_text(encoding="utf-8",
                                                              errors="replace"))
                for p in sorted(path.rglob("*")) if p.suffix in TEXT_SUFFIXES and p.is_file()]
        return TextCorpus(_split(spec, docs, held_out_percent), _split(spec, [], 1))
    if path.suffix == ".jsonl":
        return _read_jsonl(path, held_out_percent)
    text = path.read_text(encoding="utf-8", errors="replace")
    docs = [(f"{path.name}:{i}", d) for i, d in enumerate(_PARAGRAPH.split(text))]
    return TextCorpus(_split(spec, docs, held_out_percent), _split(spec, [], 1))


def _read_jsonl(path: Path, held_out_percent: int) -> TextCorpus:
    docs, prompts = [], []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: invalid JSON ({e})") from e
        if not isinstance(record, dict) or not ({"text", "prompt"} & set(record)):
            raise ValueError(f"{path}:{i + 1}: expected an object with 'text' or 'prompt'")
        key = f"{path.name}:{i}"
        if "text" in record:
            docs.append((key, str(record["text"])))
        else:
            prompts.append((key, str(record["prompt"])))
    return TextCorpus(_split(str(path), docs, held_out_percent),
                      _split(str(path), prompts, held_out_percent))


def _split(root: str, docs: list[tuple[str, str]], held_out_percent: int) -> CorpusSplit:
    train, held = [], []
    for key, text in docs:
        if text.strip():
            (held if is_held_out(key, held_out_percent) else train).append(
                CorpusFile(key, text))
    return CorpusSplit(root, tuple(train), tuple(held))

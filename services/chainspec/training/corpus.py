"""The training corpus: the running interpreter's standard-library Python source.

It exists offline on every machine with Python. Files are split into train and held-out
sets by a hash of their path relative to the stdlib root, so the split is deterministic
and file-level (no held-out file contributes a single training token).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directory names whose files are left out: test suites are huge, repetitive and full of
# deliberately odd code; site-packages is not the stdlib.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusFile:
    rel_path: str  # POSIX path relative to the corpus root
    text: str


@dataclass(frozen=True)
class CorpusSplit:
    root: str
    train: tuple[CorpusFile, ...]
    held_out: tuple[CorpusFile, ...]

    def __post_init__(self) -> None:
        overlap = {f.rel_path for f in self.train} & {f.rel_path for f in self.held_out}
        if overlap:
            raise AssertionError(f"files in both splits: {sorted(overlap)[:3]}")

    def chars(self, split: str) -> int:
        return sum(len(f.text) for f in getattr(self, split))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str, held_out_percent: int) -> bool:
    """Deterministic file-level split: sha256 of the relative path, modulo 100."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100 < held_out_percent


def list_files(root: Path, max_bytes: int) -> list[Path]:
    """*.py files under root, sorted, skipping test dirs and files over max_bytes."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or path.stat().st_size > max_bytes:
            continue
        files.append(path)
    return files


def load_split(root: Path | None = None, held_out_percent: int = 5,
               max_bytes: int = 200_000, max_files: int | None = None) -> CorpusSplit:
    """Read the corpus and split it. `max_files` keeps the first n files (tests)."""
    root = root or stdlib_root()
    paths = list_files(root, max_bytes)[:max_files]
    train, held_out = [], []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        (held_out if is_held_out(rel, held_out_percent) else train).append(
            CorpusFile(rel, text))
    return CorpusSplit(str(root), tuple(train), tuple(held_out))

"""Check a model directory before anything starts (DESIGN 2.4: an unsupported
checkpoint gets one line naming what is unsupported).

The target, and the drafter where the stack will draft, are built on the meta device
and matched against the checkpoint's headers: every tensor present with its shape, none
left over. No tensor data is read, so it takes a moment even for a large checkpoint,
and `serve`/`up` run it before Ray starts (and `--dry-run` runs it too).
"""

from __future__ import annotations

from pathlib import Path

from chainspec.models.errors import CheckpointError
from chainspec.models.loader import load_draft_model, load_target


def check_model(model_dir: str | Path, drafts: bool, must_exist: bool = True) -> None:
    """CheckpointError (one line) unless `model_dir` loads as a target and, with
    `drafts`, as a drafter. A directory missing here passes unless `must_exist` (a
    stack joining a cluster may name a path only its nodes have)."""
    path = Path(model_dir)
    if not path.is_dir():
        if must_exist:
            raise CheckpointError(f"{path}: no such model directory")
        return
    load_target(path, device="meta")
    if drafts:
        load_draft_model(path, device="meta")

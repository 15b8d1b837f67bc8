"""What `chainspec train-mtp` checks before it loads a corpus or a model, so that a bad
argument costs a second, not a corpus load or a training step: the device exists, the
target fits the window lengths, the corpus and the output folder can be used, and a
resumed run's checkpoint has the same recipe. Each failure is a ValueError of one line
naming the flag (the recipe's own numbers are checked where they are declared,
`mtp_recipe.py`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chainspec.models.config import ModelConfig
from chainspec.training import resume
from chainspec.training.mtp_export import check_target
from chainspec.training.mtp_recipe import MTPRecipe, RunSettings
from chainspec.training.text_corpus import check_spec

if TYPE_CHECKING:
    from chainspec.training.train_mtp import MTPJob


def check_job(job: MTPJob) -> None:
    check_device(job.settings.device)
    check_target(job.target, job.out)
    check_lengths(ModelConfig.from_dir(job.target).position_limit, job.recipe, job.settings)
    check_spec(job.data)
    check_writable(job.out)
    if job.resume:
        check_resume(job.out, job.recipe)


def check_device(device: str) -> None:
    """`cpu`, or `cuda[:N]` on a machine where torch sees that GPU."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if d.type == "cuda" and not torch.cuda.is_available():
        why = "built without CUDA" if torch.version.cuda is None else "no GPU visible"
        raise ValueError(f"--device {device}: CUDA is not available (torch "
                         f"{torch.__version__}: {why}); use --device cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: there are {torch.cuda.device_count()} GPU(s)")


def check_lengths(limit: int, recipe: MTPRecipe, settings: RunSettings) -> None:
    """Training windows and evaluation sequences within the target's positions."""
    if recipe.seq_len > limit:
        raise ValueError(f"--seq-len {recipe.seq_len} exceeds the target's {limit} positions")
    e = settings.eval
    longest = e.prompt_len + e.max_new_tokens + recipe.num_mtp  # a last verify's drafts
    if longest > limit:
        raise ValueError(f"--eval-prompt-len + --eval-new-tokens + K = {longest} exceeds the "
                         f"target's {limit} positions")


def check_writable(out: Path) -> None:
    """--out, or the folder it would be made in, takes files (nothing is made yet)."""
    existing = Path(os.path.abspath(out))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is not a folder")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {existing}: {e.strerror or e}") \
            from None


def check_resume(out: Path, recipe: MTPRecipe) -> None:
    """--resume: the latest checkpoint (if any) was written by this recipe."""
    found = resume.latest(resume.checkpoint_dir(out))
    if found is not None:
        blob = torch.load(found, map_location="cpu", weights_only=False, mmap=True)
        resume.check_recipe(found, blob["recipe"], recipe)

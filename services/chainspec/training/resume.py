"""Checkpoints of a `chainspec train-mtp` run: the MTP modules, the optimizer, the batch
sampler's generator and the log so far, every `checkpoint_every` steps. A run resumed
from one continues at the next step and ends with the same weights as a run that was
never stopped (same recipe, same machine).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch

from chainspec.training.mtp_model import TargetWithMTP
from chainspec.training.mtp_recipe import MTPRecipe
from chainspec.training.stage import LogRow, StageState

PATTERN = "step-*.pt"


def checkpoint_dir(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def save(folder: Path, model: TargetWithMTP, recipe: MTPRecipe, state: StageState,
         keep: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{state.step:07d}.pt"
    blob = {"recipe": recipe.as_dict(), "step": state.step,
            "mtp": model.draft.mtp.state_dict(), "optimizer": state.optimizer,
            "sampler": state.sampler, "rows": [asdict(r) for r in state.rows]}
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)  # NOTE: never a half-written checkpoint under the real name
    for old in sorted(folder.glob(PATTERN))[:-keep]:
        old.unlink()
    return path


def latest(folder: Path) -> Path | None:
    found = sorted(folder.glob(PATTERN))
    return found[-1] if found else None


def load(path: Path, model: TargetWithMTP, recipe: MTPRecipe) -> StageState:
    blob = torch.load(path, map_location=model.device, weights_only=False)
    check_recipe(path, blob["recipe"], recipe)
    model.draft.mtp.load_state_dict(blob["mtp"], strict=True)
    rows = [LogRow(**r) for r in blob["rows"]]
    return StageState(blob["step"], blob["optimizer"], blob["sampler"].cpu(), rows)


def check_recipe(path: Path, saved: dict, recipe: MTPRecipe) -> None:
    """A checkpoint resumes only the recipe that wrote it (ValueError naming the fields)."""
    saved = {"workers": 1, **saved}  # checkpoints from before `workers`
    if saved != recipe.as_dict():
        changed = sorted(k for k, v in recipe.as_dict().items() if saved.get(k) != v)
        raise ValueError(f"{path}: written by a different recipe (differs in "
                         f"{', '.join(changed)}); resume with the same options")

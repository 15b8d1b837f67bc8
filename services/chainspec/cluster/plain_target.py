"""A target without MTP modules serves plainly, and says so.

`serve` and `up` on such a model start no drafter actors (drafter mode local falls back
to remote with none) and warn, naming `chainspec train-mtp`; the controller refuses
`scale drafters N` (N > 0) with the same reason. The model's `config.json` and tensor
names are read where the check runs: a directory that cannot be read there (a path only
the actors' nodes have) is not judged, and its members report what they find.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from chainspec.cluster.config import StackConfig
from chainspec.engine.local import DrafterMode
from chainspec.models.adapters import adapter_for, architecture_of
from chainspec.models.checkpoint import CheckpointFiles
from chainspec.models.config import read_hf_config
from chainspec.models.errors import CheckpointError

TRAIN_MTP = "chainspec train-mtp"


def no_mtp_reason(model_dir: str | Path) -> str | None:
    """Why the model cannot draft (no MTP modules declared, or none of their weights in
    the checkpoint); None when it can, or when the directory cannot be judged here."""
    try:
        hf = read_hf_config(model_dir)
        adapter = adapter_for(hf)
        arch = architecture_of(hf)
        if adapter is None or adapter.num_modules(hf) < 1:
            why = "declares no MTP modules"
        else:
            layers = int(hf.get("num_hidden_layers", 0))
            with CheckpointFiles(model_dir) as files:  # headers and indexes only
                if any(adapter.owns(name, layers) for name in files.names()):
                    return None
            why = (f"declares {adapter.num_modules(hf)} MTP module(s) but its checkpoint "
                   f"holds none of their weights")
    except (CheckpointError, OSError, ValueError):
        return None
    return (f"the model at {model_dir} ({arch}) {why}, so there is nothing to draft with; "
            f"train MTP modules for it with `{TRAIN_MTP}`")


def serve_plainly(config: StackConfig) -> tuple[StackConfig, str | None]:
    """`config` with no drafters when its model cannot draft, and the warning to show
    (None when nothing changed)."""
    d = config.drafter
    if not d.local and d.replicas == 0:
        return config, None
    reason = no_mtp_reason(config.model_dir)
    if reason is None:
        return config, None
    drafter = dataclasses.replace(d, mode=DrafterMode.REMOTE, replicas=0, autoscale=None)
    return dataclasses.replace(config, drafter=drafter), \
        f"{reason}. Starting 0 drafters: the stack serves with plain decoding"


def check_stack_model(config: StackConfig, must_exist: bool = True) -> None:
    """The stack's model loads as its target and, if it drafts, as its drafter
    (headers only; `models/validate.py`), or one CheckpointError line."""
    from chainspec.models.validate import check_model
    d = config.drafter
    check_model(config.model_dir, drafts=d.local or d.replicas > 0 or d.autoscale is not None,
                must_exist=must_exist)
    if must_exist and config.verifier.tensor_parallel_size > 1:  # -tp: refused before Ray
        from chainspec.engine.tp_launch import check_model as check_tp
        check_tp(config.model_dir, config.verifier.tensor_parallel_size)
    if must_exist and d.tensor_parallel_size > 1 and (d.replicas > 0 or d.autoscale):
        from chainspec.engine.tp_launch import check_model as check_tp
        check_tp(config.model_dir, d.tensor_parallel_size, draft=True)


def refuse_drafters(config: StackConfig) -> None:
    """ValueError (the reason) if drafters cannot be added to this stack's model."""
    reason = no_mtp_reason(config.model_dir)
    if reason is not None:
        raise ValueError(f"cannot add drafters: {reason}; this stack serves with plain "
                         f"decoding")

"""`--revision` and `--download-dir` (vLLM's flags), and the one place a command turns a
Hub id in `--model` into the local directory every member then loads (`models/hub.py`).

NOTE: resolved once, in the command, before Ray starts: actors on this node read the
resolved path. A stack on a cluster of several nodes needs the model where its members
run (the chart's `model.hub` init container, or a volume).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from chainspec.models.hub import is_hub_id, resolve_model

if TYPE_CHECKING:
    from chainspec.cluster.config import StackConfig


def add_hub_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hub model id given as the model "
                        "(default: main)")
    p.add_argument("--download-dir", type=Path, default=None,
                   help="Hugging Face cache to read and download Hub models into "
                        "(default: HF_HUB_CACHE, ~/.cache/huggingface/hub)")


def local_model(config: StackConfig, args: argparse.Namespace) -> StackConfig:
    """`config` with a Hub id model replaced by its local snapshot directory (fetched
    unless cached; HF_HUB_OFFLINE=1: the cache only). A directory, or a path that is
    not here (a cluster's nodes may have it), is left as it is."""
    if not is_hub_id(config.model_dir):
        return config
    path = resolve_model(config.model_dir, getattr(args, "revision", None),
                         getattr(args, "download_dir", None))
    return dataclasses.replace(config, model_dir=str(path))

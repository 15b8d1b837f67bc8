"""The one place a command turns a Hub id in `--model` (at `--revision`, in
`--download-dir`: vLLM's flags, spine keys `revision`/`download_dir`) into the local
directory every member then loads (`models/hub.py`).

NOTE: resolved once, in the command, before Ray starts: actors on this node read the
resolved path. A stack on a cluster of several nodes needs the model where its members
run (the chart's `model.hub` init container, or a volume).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from chainspec.models.hub import is_hub_id, resolve_model

if TYPE_CHECKING:
    from chainspec.cluster.config import StackConfig


def local_model(config: StackConfig) -> StackConfig:
    """`config` with a Hub id model replaced by its local snapshot directory (fetched
    unless cached; HF_HUB_OFFLINE=1: the cache only), at `config.revision` in
    `config.download_dir` (the spine's `revision`/`download_dir`: `--revision`,
    `--download-dir` or a config file). A directory, or a path that is not here (a
    cluster's nodes may have it), is left as it is."""
    if not is_hub_id(config.model_dir):
        return config
    path = resolve_model(config.model_dir, config.revision,
                         Path(config.download_dir) if config.download_dir else None)
    return dataclasses.replace(config, model_dir=str(path))

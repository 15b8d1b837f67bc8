"""What a model family is (DESIGN 2.4, STYLE 11): data plus small glue, in one file.

A family parses its `config.json` into a `ModelConfig` (or a frozen subclass with the
family's own fields), builds its decoder layers (each an attention kind and an MLP kind
that declares its cache spec), names its checkpoint tensors, and says where its MTP
layers live and how they are wired (`mtp`, `mtp_block`). The engine sees none of this:
it asks the model for its cache specs and runs `forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chainspec.models.config import ModelConfig


@dataclass
class DecoderParts:
    """What a family builds for `TargetModel`: its layers, the rotary tables they share
    (registered once on the model so they move with it) and the final norm."""

    layers: list[nn.Module]  # forward(x, positions, backend) -> x; cache_spec()
    rotaries: list[nn.Module]
    norm: nn.Module


@dataclass(frozen=True)
class MTPBlock:
    """An MTP module's decoder layer and the rotary tables it uses."""

    layer: nn.Module  # forward(x, positions, backend) -> x; cache_spec(); layer_id 0
    rotaries: list[nn.Module]


def identity_name(key: str) -> str:
    return key


def unchanged(key: str, tensor: torch.Tensor) -> torch.Tensor:
    del key
    return tensor


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    parse: Callable[[dict[str, Any], str], ModelConfig]  # (config.json, architecture)
    build: Callable[[ModelConfig, int | None], DecoderParts]  # (config, cache_len)
    # canonical `TargetModel` state key -> checkpoint tensor name (HF names: identity)
    checkpoint_name: Callable[[str], str] = identity_name
    # checkpoint name prefixes of parts the family does not serve (a multimodal release's
    # vision tower): left unread, with one warning line
    unread: tuple[str, ...] = ()
    # a checkpoint tensor brought to chainspec's convention (e.g. zero-centred norms)
    convert: Callable[[str, torch.Tensor], torch.Tensor] = unchanged
    mtp: Any = None  # MTPAdapter: where the family's MTP tensors live and their glue
    mtp_block: Callable[[ModelConfig, int | None], MTPBlock] | None = None
    notes: str = ""  # one line for docs and errors: layer kinds, MTP layout
    # the exported h is the last layer's output before the final norm (what the family's
    # MTP layers read); `TargetModel.logits` applies the norm
    hidden_before_norm: bool = False

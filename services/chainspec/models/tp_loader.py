"""Load one tensor-parallel rank's shard of a target (DESIGN 4.10).

The model is built with empty (meta) parameters, `shard_target` rewrites it into the
rank's shard, and each parameter is read from the safetensors files as exactly the slice
the rank holds (`CheckpointFiles.read_part`): no rank ever holds a full copy of a sharded
tensor. Strictness is `load_target`'s: every tensor found with its full stored shape, no
leftovers in the part of the checkpoint the target owns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from chainspec.models import moe
from chainspec.models.adapters import adapter_for, draft_config
from chainspec.models.checkpoint import CheckpointFiles
from chainspec.models.config import ModelConfig, read_hf_config
from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import identity_name
from chainspec.models.loader import (
    _assign,
    _check_unexpected,
    _check_unexpected_mtp,
    _family,
    _module_count,
    _parse_config,
    _unread,
)
from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel
from chainspec.models.tensor_parallel import (
    Shard,
    TPGroup,
    check_divides,
    empty_weights,
    shard_draft,
    shard_target,
)


def load_target_shard(model_dir: str | Path, tp: TPGroup, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu", cache_len: int | None = None,
                      architecture: str | None = None) -> TargetModel:
    """Rank `tp.rank`'s shard of the target of `model_dir`. `model.tp_shards`: the slice
    of each sharded parameter; `model.tp_bytes_read`: the tensor bytes this rank read."""
    hf = read_hf_config(model_dir)
    cfg = _parse_config(model_dir, lambda: ModelConfig.from_hf(hf, architecture))
    check_divides(cfg, tp.world)
    adapter = adapter_for(hf, architecture)
    with empty_weights():
        model = TargetModel(cfg, cache_len)
    _buffers_to(model, device)
    shards = shard_target(model, tp)
    name_of = model.family.checkpoint_name
    expected = model.state_dict()
    names = {key: name_of(key) for key in expected}
    known = set(names.values())
    if cfg.tie_word_embeddings:
        names["lm_head.weight"] = name_of("model.embed_tokens.weight")
    state, read = {}, 0
    with CheckpointFiles(model_dir) as files:
        owned = {n for n in files.names() if adapter and adapter.owns(n, cfg.num_layers)}
        _check_unexpected(files, known | owned | _unread(files, model.family.unread))
        present = files.names()
        for key, name in names.items():
            tensor = _read(files, name, shards.get(key), tuple(expected[key].shape), present)
            read += tensor.numel() * tensor.element_size()
            keep = key.endswith(moe.FP32_SUFFIXES)  # e.g. the router's correction bias
            state[key] = tensor.to(device=device, dtype=torch.float32 if keep else dtype)
    _assign(model, state, model.model.embed_tokens if cfg.tie_word_embeddings else None)
    model.tp_shards, model.tp_bytes_read = shards, read
    return model


def load_draft_shard(model_dir: str | Path, tp: TPGroup, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu", num_modules: int | None = None,
                     cache_len: int | None = None) -> MTPDraftModel:
    """Rank `tp.rank`'s shard of the MTP drafter of `model_dir` (`load_draft_model`'s
    names and checks; only the rank's slices read)."""
    hf = read_hf_config(model_dir)
    adapter = _parse_config(model_dir, lambda: adapter_for(hf, None, None))
    if adapter is None:
        raise CheckpointError(f"{model_dir}: the architecture declares no MTP modules")
    cfg = _parse_config(model_dir, lambda: draft_config(hf, adapter, None))
    check_divides(cfg, tp.world)
    count = _module_count(model_dir, cfg.num_mtp_layers, num_modules)
    family = _family(cfg)
    with empty_weights():
        model = MTPDraftModel(cfg, count, adapter.glue, cache_len,
                              family.mtp_block if family else None)
    _buffers_to(model, device)
    shards = shard_draft(model, tp)
    rename = family.checkpoint_name if family else identity_name
    expected = model.state_dict()
    names = {key: rename(adapter.checkpoint_name(key, cfg.num_layers)) for key in expected}
    if cfg.tie_word_embeddings:
        names["lm_head.weight"] = rename("model.embed_tokens.weight")
    state, read = {}, 0
    with CheckpointFiles(model_dir) as files:
        _check_unexpected_mtp(files, adapter, model, cfg, rename)
        present = files.names()
        for key, name in names.items():
            tensor = _read(files, name, shards.get(key), tuple(expected[key].shape), present)
            read += tensor.numel() * tensor.element_size()
            tensor = adapter.convert(key, tensor)  # elementwise (norm offsets): slice-safe
            keep = key.endswith(moe.FP32_SUFFIXES)
            state[key] = tensor.to(device=device, dtype=torch.float32 if keep else dtype)
    _assign(model, state, model.embed_tokens if cfg.tie_word_embeddings else None)
    model.tp_shards, model.tp_bytes_read = shards, read
    return model


def _buffers_to(model: torch.nn.Module, device: torch.device | str) -> None:
    """Buffers (rotary tables) to `device`; parameters stay meta until assigned."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)


def _read(files: CheckpointFiles, name: str, shard: Shard | None, shape: tuple[int, ...],
          present: set[str]) -> torch.Tensor:
    """The rank's part of one parameter. Stacked experts stored per expert (or as
    stacked halves, `models/moe.py`) read only the rank's experts."""
    if shard is None:
        return files.read(name, shape)
    try:
        parts = moe.expert_parts(name, shard.full, present)
    except CheckpointError as e:
        raise CheckpointError(f"{files.model_dir}: {e}") from e
    if parts is None:
        return torch.cat([files.read_part(name, shard.full, shard.dim, a, b)
                          for a, b in shard.ranges], dim=shard.dim)
    if shard.dim != 0:
        raise CheckpointError(f"{name}: experts split along dim {shard.dim}")
    num, rows, cols = shard.full
    if parts.halves:  # [E, I, H] per half: the rank's experts of each
        return torch.cat([files.read_part(n, (num, rows // 2, cols), 0, shard.start,
                                          shard.stop) for n in parts.per_expert[0]], dim=1)
    mine = dataclasses.replace(parts, shape=(shard.stop - shard.start, rows, cols),
                               per_expert=parts.per_expert[shard.start:shard.stop])
    return mine.read(files.read)

"""Build the target and the MTP drafter from a Hugging Face model directory.

Both loads are strict: every parameter must be found with the right shape, and no
tensor in the part of the checkpoint a load is responsible for may be left over.
- `load_target` owns every tensor except those of the MTP family the config declares
  (and a tied `lm_head.weight`).
- `load_draft_model` reads only the embedding, the LM head and the MTP tensors; target
  layers are never read, and shards that hold only target layers are never opened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from chainspec.models import moe
from chainspec.models.adapters import (
    MTPAdapter,
    adapter_for,
    architecture_of,
    draft_config,
)
from chainspec.models.checkpoint import CheckpointFiles
from chainspec.models.config import ModelConfig, read_hf_config
from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import Family, identity_name
from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel

# Buffers that older checkpoints saved; chainspec recomputes them.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
LISTED = 5  # names shown in an error message before "..."
T = TypeVar("T")
log = logging.getLogger(__name__)


def load_target(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", cache_len: int | None = None,
                architecture: str | None = None) -> TargetModel:
    """The target decoder of `model_dir` (`architecture` overrides `architectures[0]`)."""
    hf = read_hf_config(model_dir)
    cfg = _parse_config(model_dir, lambda: ModelConfig.from_hf(hf, architecture))
    adapter = adapter_for(hf, architecture)
    with torch.device(device):
        model = TargetModel(cfg, cache_len)
    name_of = model.family.checkpoint_name
    names = {key: name_of(key) for key in model.state_dict()}
    known = set(names.values())  # a tied checkpoint may still carry lm_head.weight
    if cfg.tie_word_embeddings:
        names["lm_head.weight"] = name_of("model.embed_tokens.weight")
    with CheckpointFiles(model_dir) as files:
        owned = {n for n in files.names() if adapter and adapter.owns(n, cfg.num_layers)}
        _check_unexpected(files, known | owned | _unread(files, model.family.unread))
        state = _read_all(files, names, model, dtype, device)
    _assign(model, state, model.model.embed_tokens if cfg.tie_word_embeddings else None)
    return model


def load_draft_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu", num_modules: int | None = None,
                     cache_len: int | None = None, architecture: str | None = None,
                     family: str | None = None) -> MTPDraftModel:
    """The drafter's model: shared embedding and LM head plus the first `num_modules` MTP
    modules (default: all the config declares). `family` overrides the adapter choice."""
    hf = read_hf_config(model_dir)
    adapter = _parse_config(model_dir, lambda: adapter_for(hf, architecture, family))
    if adapter is None:
        raise CheckpointError(f"{_config_path(model_dir)}: architecture "
                              f"{architecture_of(hf, architecture)!r} declares no MTP modules")
    cfg = _parse_config(model_dir, lambda: draft_config(hf, adapter, architecture))
    count = _module_count(model_dir, cfg.num_mtp_layers, num_modules)
    family = _family(cfg)
    with torch.device(device):
        model = MTPDraftModel(cfg, count, adapter.glue, cache_len,
                              family.mtp_block if family else None)
    rename = family.checkpoint_name if family else identity_name  # the target's layout
    names = {key: rename(adapter.checkpoint_name(key, cfg.num_layers))
             for key in model.state_dict()}
    if cfg.tie_word_embeddings:
        names["lm_head.weight"] = rename("model.embed_tokens.weight")
    with CheckpointFiles(model_dir) as files:
        _check_unexpected_mtp(files, adapter, model, cfg, rename)
        state = _read_all(files, names, model, dtype, device, adapter.convert)
    _assign(model, state, model.embed_tokens if cfg.tie_word_embeddings else None)
    return model


def _family(cfg: ModelConfig) -> Family | None:
    """The target family (its MTP decoder layer and tensor layout); None for
    architectures chainspec drafts for but does not serve as targets (a Llama-style
    layer, HF names)."""
    from chainspec.models.families import registry
    return registry().get(cfg.architecture)


def _unread(files: CheckpointFiles, prefixes: tuple[str, ...]) -> set[str]:
    """Tensors of parts the family does not serve, named in one warning line."""
    unread = {n for n in files.names() if n.startswith(prefixes)} if prefixes else set()
    if unread:
        log.warning("%s: %d tensors under %s left unread (not part of the text model "
                    "chainspec serves)", files.model_dir, len(unread), ", ".join(prefixes))
    return unread


def _config_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / "config.json"


def _parse_config(model_dir: str | Path, parse: Callable[[], T]) -> T:
    """Run a config parser; its errors name config.json."""
    try:
        return parse()
    except KeyError as e:
        raise CheckpointError(f"{_config_path(model_dir)}: missing required field "
                              f"{e.args[0]!r}") from e
    except CheckpointError as e:
        raise CheckpointError(f"{_config_path(model_dir)}: {e}") from e


def _module_count(model_dir: str | Path, available: int, asked: int | None) -> int:
    count = available if asked is None else asked
    if available < 1:
        raise CheckpointError(f"{_config_path(model_dir)}: the config declares no MTP modules")
    if not 1 <= count <= available:
        raise CheckpointError(f"{_config_path(model_dir)}: asked for {count} MTP modules, the "
                              f"checkpoint has {available}")
    return count


def _listed(names: set[str]) -> str:
    shown = sorted(names)[:LISTED]
    return ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > LISTED else "")


def _check_unexpected(files: CheckpointFiles, known: set[str]) -> None:
    extra = {n for n in files.names() - known if not n.endswith(IGNORED_SUFFIXES)
             and moe.stacked_name(n) not in known}  # experts stored per expert: read stacked
    if extra:
        where = sorted({files.file_of(n).name for n in extra})
        raise CheckpointError(f"{files.model_dir}: unexpected tensors {_listed(extra)} "
                              f"(in {', '.join(where)})")


def _check_unexpected_mtp(files: CheckpointFiles, adapter: MTPAdapter, model: MTPDraftModel,
                          cfg: ModelConfig, rename: Callable[[str], str]) -> None:
    """Every tensor in the family's MTP namespace must map onto a declared module."""
    n_layers, declared = cfg.num_layers, cfg.num_mtp_layers
    module_keys = list(model.mtp[0].state_dict())
    known = {rename(adapter.checkpoint_name(f"mtp.{i}.{key}", n_layers))
             for i in range(declared) for key in module_keys}
    owned = {n for n in files.names() if adapter.owns(n, n_layers)
             and not adapter.is_shared_copy(n, n_layers, declared)}
    _check_unexpected(files, (files.names() - owned) | known)


def _read_all(files: CheckpointFiles, names: dict[str, str], model: nn.Module,
              dtype: torch.dtype, device: torch.device | str,
              convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
              ) -> dict[str, torch.Tensor]:
    """Read `names` (model key -> checkpoint name): all present first, then shapes."""
    present = files.names()
    expected = model.state_dict()
    try:  # stacked experts may be stored per expert (models/moe.py)
        parts = {key: moe.expert_parts(name, tuple(expected[key].shape), present)
                 for key, name in names.items()}
    except CheckpointError as e:
        raise CheckpointError(f"{files.model_dir}: {e}") from e
    stored = {n for key, name in names.items()
              for n in (parts[key].names if parts[key] else [name])}
    missing = stored - present
    if missing:
        raise CheckpointError(f"{files.model_dir}: missing tensor {_listed(missing)}")
    state = {}
    fp32 = moe.fp32_keys(model)
    headers_only = torch.device(device).type == "meta"  # a check (`models/validate.py`)
    for key, name in names.items():
        def read(n: str, shape: tuple[int, ...]) -> torch.Tensor:
            return files.read(n, shape, data=not headers_only)
        split = parts[key]
        tensor = split.read(read) if split else read(name, tuple(expected[key].shape))
        tensor = convert(key, tensor) if convert else tensor
        keep = key.endswith(moe.FP32_SUFFIXES) or key in fp32  # router bias, MiMo's gate
        state[key] = tensor.to(device=device, dtype=torch.float32 if keep else dtype)
    return state


def _assign(model: nn.Module, state: dict[str, torch.Tensor], tied_to: nn.Embedding | None
            ) -> None:
    model.load_state_dict(state, strict=True, assign=True)
    if tied_to is not None:
        model.lm_head.weight = tied_to.weight  # one parameter, as the model was built

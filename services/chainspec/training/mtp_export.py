"""`chainspec train-mtp`'s output folder: the target's files (linked, or copied) plus
trained MTP modules in the DeepSeek-V3 layout, which every chainspec loader reads.

- `mtp.safetensors`: module i as `model.layers.{N+i}.*` (`export.mtp_tensors`), in the
  target's dtype; no embedding or head (shared with the target, stored once);
- `config.json`: the target's, plus `num_nextn_predict_layers` = K;
- every other file of the target: a symbolic link to it (or a copy), never modified.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from chainspec.models.adapters import adapter_for
from chainspec.models.checkpoint import CheckpointFiles
from chainspec.models.config import read_hf_config
from chainspec.training.export import DTYPES
from chainspec.training.mtp_model import TargetWithMTP

MTP_FILE = "mtp.safetensors"
OWN_FILES = frozenset({"config.json", MTP_FILE, "README.md"})


def check_target(target_dir: Path, out_dir: Path) -> None:
    """A target for train-mtp: its own folder, no MTP modules of its own."""
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError("--out must differ from --target (the target stays untouched)")
    hf = read_hf_config(target_dir)
    adapter = adapter_for(hf)
    if adapter is not None and mtp_weights_present(target_dir, adapter, hf):
        raise ValueError(f"{target_dir} already ships MTP modules; train-mtp trains "
                         "drafters for targets without them (or whose release dropped them)")
    if (target_dir / MTP_FILE).exists():
        raise ValueError(f"{target_dir / MTP_FILE} exists but config.json declares no "
                         "MTP modules; remove it or point --target elsewhere")


def mtp_weights_present(target_dir: Path, adapter, hf: dict) -> bool:
    """Whether the checkpoint holds any tensor of its family's MTP layers (headers only)."""
    layers = int(hf.get("num_hidden_layers", 0))
    with CheckpointFiles(target_dir) as files:
        return any(adapter.owns(name, layers) for name in files.names())


def family_mtp_tensors(model: TargetWithMTP, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The trained modules under the target family's own MTP tensor names."""
    layers, adapter = model.config.num_layers, model.adapter
    out: dict[str, torch.Tensor] = {}
    for key, t in model.draft.state_dict().items():
        if not key.startswith("mtp."):
            continue  # the embedding and head are the target's
        name = adapter.checkpoint_name(key, layers)
        if name in out:
            raise ValueError(f"the {adapter.family} MTP layout shares {name} between "
                             f"modules: train one module (--num-mtp 1) for this target")
        if adapter.zero_centred_block_norms and ".block." in key and key.endswith(
                "norm.weight"):
            t = t.float() - 1.0  # NOTE: stored as w for (1 + w), as the family loads it
        out[name] = t.detach().to(dtype).contiguous()
    return out


def storage_dtype(target_dir: Path) -> torch.dtype:
    hf = read_hf_config(target_dir)
    return DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype")), torch.bfloat16)


def write_folder(model: TargetWithMTP, target_dir: Path, out_dir: Path, copy: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(target_dir.iterdir()):
        if src.name in OWN_FILES or not src.is_file():
            continue
        dst = out_dir / src.name
        if dst.is_symlink() or dst.exists():
            dst.unlink()
        if copy:
            shutil.copyfile(src, dst)
        else:
            dst.symlink_to(src.resolve())
    hf = read_hf_config(target_dir)
    hf[model.adapter.count_keys[0]] = model.num_mtp
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {k: v.cpu() for k, v in family_mtp_tensors(model, storage_dtype(target_dir))
               .items()}
    save_file(tensors, str(out_dir / MTP_FILE), {"format": "pt"})

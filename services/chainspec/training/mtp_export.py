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
from chainspec.models.config import read_hf_config
from chainspec.training.export import DTYPES, mtp_tensors
from chainspec.training.mtp_model import TargetWithMTP

MTP_FILE = "mtp.safetensors"
OWN_FILES = frozenset({"config.json", MTP_FILE, "README.md"})


def check_target(target_dir: Path, out_dir: Path) -> None:
    """A target for train-mtp: its own folder, no MTP modules of its own."""
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError("--out must differ from --target (the target stays untouched)")
    hf = read_hf_config(target_dir)
    if adapter_for(hf) is not None:
        raise ValueError(f"{target_dir} already declares MTP modules; train-mtp trains "
                         "drafters for targets without them")
    if (target_dir / MTP_FILE).exists():
        raise ValueError(f"{target_dir / MTP_FILE} exists but config.json declares no "
                         "MTP modules; remove it or point --target elsewhere")


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
    hf["num_nextn_predict_layers"] = model.num_mtp
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {k: v.cpu() for k, v in mtp_tensors(model, storage_dtype(target_dir)).items()}
    save_file(tensors, str(out_dir / MTP_FILE), {"format": "pt"})

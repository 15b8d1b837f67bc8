"""Tiny Qwen3.5, DeepSeek-V3, MiMo-V2-Flash, Qwen3-Next and Qwen3.5-MoE model directories
that `serve`, `train-mtp` and the acceptance audit take: the families' own checkpoint builders
(tests/unit/families/*_checkpoint.py: transformers' `save_pretrained` plus MTP tensors in
each family's native layout), a byte-level tokenizer, and weights shaped so that drafts
are at stake:

- the target is quiet (the attention/MLP/GDN outputs that join the residual stream are
  scaled by `QUIET`), so its next token depends mostly on the current one;
- each MTP layer passes enorm(Emb(x[p+k])) through its input projection (plus a little
  of the hidden state), its block adds little, and its final norm is the target's: step k
  guesses the target's token after x[p+k] from that token alone.

Outputs still depend on context (nothing is zero), so a drafter that reads the wrong
hidden state or token moves acceptance, never output.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from tests.integration.tiny_checkpoint import write_tokenizer
from tests.unit.families import deepseek_v3_checkpoint as deepseek
from tests.unit.families import glm4_moe_lite_checkpoint as glm_lite
from tests.unit.families import mimo_v2_flash_checkpoint as mimo
from tests.unit.families import qwen3_5_checkpoint as qwen
from tests.unit.families import qwen3_next_checkpoint as qwen_moe

FAMILIES = ("qwen3_5", "deepseek_v3", "mimo_v2_flash", "qwen3_next", "qwen3_5_moe")
QUIET = 0.05
# MLA + MoE targets with MoE MTP layers, served only (test_family_serve.py): agreeing
# drafters, routed scaling 1 so the MoE layers do not drown the last token
MOE_MLA = {
    "deepseek_v3_moe": lambda path, seed, **shape: deepseek.write_with_mtp(
        path, seed=seed, agreeing=True, **{**deepseek.MOE, "routed_scaling_factor": 1.0},
        **shape),
    "glm4_moe_lite": lambda path, seed, **shape: glm_lite.write_with_mtp(
        path, seed=seed + 2, agreeing=True, routed_scaling_factor=1.0, **shape),
}
SERVED = (*FAMILIES, *MOE_MLA)
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "out_proj.weight",
                    "experts.down_proj")  # stacked experts: [E, H, I]
ZERO_CENTRED = ("qwen3_5", "qwen3_next", "qwen3_5_moe")  # norms scale by (1 + w)
# Qwen3-Next and Qwen3.5-MoE: the Qwen3.5 builders' interface over qwen3_next_checkpoint
QWEN_MOE = {f: SimpleNamespace(write_target=partial(qwen_moe.write_target, f),
                               write_mtp=partial(qwen_moe.write_mtp, f))
            for f in ("qwen3_next", "qwen3_5_moe")}
# where each family's MTP layer i keeps its input projection, input norms and final norm
_GLUE = {
    "qwen3_5": lambda i: ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                          "mtp.norm.weight", "mtp.layers.{i}."),
    "qwen3_next": lambda i: _GLUE["qwen3_5"](i),
    "qwen3_5_moe": lambda i: _GLUE["qwen3_5"](i),
    "mimo_v2_flash": lambda i: (f"model.mtp.layers.{i}.eh_proj.weight",
                                f"model.mtp.layers.{i}.enorm.weight",
                                f"model.mtp.layers.{i}.final_layernorm.weight",
                                f"model.mtp.layers.{i}."),
}


def _quiet(model: torch.nn.Module, factor: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(RESIDUAL_OUTPUTS):
                p.mul_(factor)


def _agree(path: Path, family: str, hf) -> None:
    """Rewrite `mtp.safetensors` so that every layer guesses the quiet target."""
    tensors = load_file(str(path / "mtp.safetensors"))
    h = hf.config.hidden_size
    layers = {int(n.split("layers.")[1].split(".")[0]) for n in tensors if "layers." in n}
    unit = 0.0 if family in ZERO_CENTRED else 1.0
    for i in sorted(layers):
        proj, enorm, final, block = _GLUE[family](i)
        tensors[proj] = torch.cat([torch.eye(h), 0.3 * tensors[proj][:, h:]], 1)
        tensors[enorm] = torch.full((h,), unit)
        tensors[final] = hf.model.norm.weight.detach().clone()
        for name in tensors:
            if name.startswith(block.format(i=i)) and name.endswith(RESIDUAL_OUTPUTS):
                tensors[name] = tensors[name] * 0.1
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))


def write_family(path: Path, family: str, mtp: bool = True, seed: int = 0) -> Path:
    """A model directory of `family` (tokenizer, target, and with `mtp` its native MTP
    layers; without, a target for `train-mtp` whose config declares none)."""
    eot = write_tokenizer(path, 300)
    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    shape = dict(vocab_size=vocab, eos_token_id=eot, bos_token_id=eot)
    if family == "deepseek_v3":
        if mtp:
            deepseek.write_with_mtp(path, seed=seed, agreeing=True, **shape)
        else:
            deepseek.write_target(path, seed, QUIET, num_nextn_predict_layers=0, **shape)
        return path
    if family in MOE_MLA:
        assert mtp, f"{family}: served with its native MTP layers only"
        MOE_MLA[family](path, seed, **shape)
        return path
    builder = QWEN_MOE.get(family) or (qwen if family == "qwen3_5" else mimo)
    extra = {"mtp_num_hidden_layers": 1} if family in ZERO_CENTRED and mtp else {}
    hf = builder.write_target(path, seed, **shape, **extra)
    _quiet(hf, QUIET)
    hf.save_pretrained(path)
    if mtp:
        builder.write_mtp(path, hf.config, seed + 1)
        _agree(path, family, hf)
    return path


def mtp_layout(path: Path) -> set[str]:
    """The prefixes of a directory's MTP tensors, up to the layer index."""
    names = load_file(str(path / "mtp.safetensors"))
    return {n.split("layers.")[0] + "layers." + n.split("layers.")[1].split(".")[0]
            if "layers." in n else n for n in names}


def declared_mtp(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)

"""Tiny MiMo-V2-Flash and Step-3.5-Flash model directories with MoE layers that `serve`,
`train-mtp` and the acceptance audit take, shaped as tests/integration/family_models.py
shapes the dense families: a byte-level tokenizer; a quiet target (attention, MLP, expert
and shared-expert outputs scaled by `QUIET`, so its next token depends mostly on the
current one), built by the families' MoE checkpoint builders
(tests/unit/families/{mimo_v2_flash,step3}_moe_checkpoint.py: the sparse layers in the
hub's layout); and native MTP layers that agree with it: each passes enorm(Emb(x[p+k]))
through its input projection (plus a little of the hidden state), its block adds little,
and its final norm and head are the target's.

Outputs still depend on context, so a drafter that reads the wrong hidden state or token
moves acceptance, never output."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from tests.integration.tiny_checkpoint import write_tokenizer
from tests.unit.families import mimo_v2_flash_checkpoint as mimo
from tests.unit.families import mimo_v2_flash_moe_checkpoint as mimo_moe
from tests.unit.families import step3_checkpoint as step
from tests.unit.families import step3_moe_checkpoint as step_moe

FAMILIES = ("mimo_v2_flash_moe", "step3_moe")
QUIET = 0.05
BLOCK_OUTPUTS = ("o_proj.weight", "down_proj.weight")


def _agree(path: Path, prefixes: list[str], norm: torch.Tensor, head: torch.Tensor,
           glue: dict[str, str], unit: float) -> None:
    """Rewrite `mtp.safetensors` so that every MTP layer (at `prefixes`) guesses the quiet
    target; `glue`: the layer's input projection, embedding norm, final norm (and head)."""
    tensors = load_file(str(path / "mtp.safetensors"))
    hidden = norm.shape[0]
    for p in prefixes:
        names = {k: p + v for k, v in glue.items()}
        tensors[names["proj"]] = torch.cat(
            [torch.eye(hidden), 0.3 * tensors[names["proj"]][:, hidden:]], 1)
        tensors[names["enorm"]] = torch.full((hidden,), unit)
        tensors[names["final"]] = norm.clone()
        if "head" in names:
            tensors[names["head"]] = head.clone()
        for name in tensors:
            if name.startswith(p) and name.endswith(BLOCK_OUTPUTS):
                tensors[name] = tensors[name] * 0.1
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))


def _mimo(path: Path, shape: dict, mtp: bool, seed: int) -> None:
    extra = {} if mtp else {"num_nextn_predict_layers": 0}
    hf = mimo_moe.write_target(path, seed, QUIET, **shape, **extra)
    if mtp:
        mimo.write_mtp(path, hf.config, seed + 1)
        _agree(path, [f"model.mtp.layers.{i}." for i in range(mimo.NUM_MTP)],
               hf.model.norm.weight.detach(), hf.lm_head.weight.detach(),
               dict(proj="eh_proj.weight", enorm="enorm.weight",
                    final="final_layernorm.weight"), unit=1.0)


def _step(path: Path, shape: dict, mtp: bool, seed: int) -> None:
    hf = step_moe.write_target(path, seed, QUIET, **shape)
    if not mtp:  # the config's lists keep their MTP entries (train-mtp re-counts modules)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    else:
        step.write_mtp(path, hf.config, seed + 1)
        n = hf.config.num_hidden_layers  # the hub's MTP layers: model.layers.{N+i}
        _agree(path, [f"model.layers.{n + i}." for i in range(step.NUM_MTP)],
               hf.model.norm.weight.detach(), hf.lm_head.weight.detach(),
               dict(proj="eh_proj.weight", enorm="enorm.weight",
                    final="shared_head.norm.weight", head="shared_head.output.weight"),
               unit=0.0)  # zero-centred norms: (1 + w)


def write_family(path: Path, family: str, mtp: bool = True, seed: int = 0) -> Path:
    """A model directory of `family` (tokenizer, quiet MoE target, and with `mtp` its
    agreeing native MTP layers; without, a target for `train-mtp` declaring none)."""
    eot = write_tokenizer(path, 300)
    vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    shape = dict(vocab_size=vocab, eos_token_id=eot, bos_token_id=eot)
    {"mimo_v2_flash_moe": _mimo, "step3_moe": _step}[family](path, shape, mtp, seed)
    return path

"""Tiny random MiMo-V2-Flash checkpoints with sparse layers: transformers' own
`MiMoV2FlashForCausalLM` with `mlp_layer_types` dense, sparse, sparse, sparse (its
`MiMoV2FlashMoE`: 8 experts, top-2, group-limited routing 4 groups / 2 kept, a routed
scaling factor, no shared experts), saved by `save_pretrained` (experts per expert, as the
hub stores them), the correction bias random too (a zero bias would hide a router that
ignores it); the three dense MTP layers as `mimo_v2_flash_checkpoint.write_mtp` writes
them."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import MiMoV2FlashForCausalLM

from tests.unit.families.mimo_v2_flash_checkpoint import _randomise, hf_config, write_mtp

MOE = dict(mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_routed_experts=8,
           num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=16,
           routed_scaling_factor=2.5, norm_topk_prob=True)


RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


def quiet(model: torch.nn.Module, factor: float) -> None:
    """Scale what joins the residual stream (attention, MLP and expert outputs)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(RESIDUAL_OUTPUTS):
                p.mul_(factor)


def write_target(path: Path, seed: int = 0, quiet_by: float = 1.0, **extra
                 ) -> MiMoV2FlashForCausalLM:
    """`quiet_by` < 1: a quiet target (tests/integration/flash_moe_models.py)."""
    torch.manual_seed(seed)
    model = MiMoV2FlashForCausalLM(hf_config(**{**MOE, **extra})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _randomise(dict(model.named_parameters()), gen)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    quiet(model, quiet_by)
    model.save_pretrained(path)
    return model


def write_checkpoint(path: Path, seed: int = 0, **extra) -> MiMoV2FlashForCausalLM:
    model = write_target(path, seed, **extra)
    write_mtp(path, model.config, seed + 1)
    return model

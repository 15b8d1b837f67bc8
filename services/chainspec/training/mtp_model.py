"""A frozen-or-trainable target plus K chained MTP modules (DeepSeek-V3 section 2.2) that
share the target's embedding and LM head: what every training stage and evaluation runs.

The demo trainer builds one from scratch (`DemoModel`); `chainspec train-mtp` wraps a
target loaded from a checkpoint of any supported family.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from chainspec.models.adapters import DEEPSEEK
from chainspec.models.mtp import MTPDraftModel, MTPGlue
from chainspec.models.target import TargetModel

# DeepSeek glue: concat [emb, hidden], plain RMSNorm weights (the layout train-mtp writes).
DEEPSEEK_GLUE = MTPGlue(hidden_first=False, unit_offset_norms=False)


class TargetWithMTP(nn.Module):
    def __init__(self, target: TargetModel, num_mtp: int) -> None:
        super().__init__()
        self.config = replace(target.config, num_mtp_layers=num_mtp)
        self.target = target
        # the target family's MTP layout and block (DeepSeek's for the Llama family)
        self.adapter = target.family.mtp or DEEPSEEK
        self.draft = MTPDraftModel(self.config, num_mtp, self.adapter.glue,
                                   block=target.family.mtp_block)
        # NOTE: shared modules, not copies: the drafter reads the target's embedding/head.
        self.draft.embed_tokens = target.model.embed_tokens
        self.draft.lm_head = target.lm_head

    @property
    def num_mtp(self) -> int:
        return self.draft.num_modules

    @property
    def device(self) -> torch.device:
        return self.target.lm_head.weight.device

    def mtp_parameters(self) -> list[nn.Parameter]:
        return list(self.draft.mtp.parameters())

    def init_mtp(self, seed: int, std: float = 0.02) -> None:
        """Fresh MTP modules: the same rule as `init_normal`, over the modules only."""
        init_normal(self.draft.mtp, seed, std, self.config.num_layers + self.num_mtp)
        if self.adapter.glue.own_heads:  # each module's own head starts as the target's
            with torch.no_grad():
                for module in self.draft.mtp:
                    module.head.weight.copy_(self.target.lm_head.weight)


def init_normal(module: nn.Module, seed: int, std: float, depth: int) -> None:
    """Normal(0, std) for matrices (residual outputs scaled by 1/sqrt(2 * depth)), zeros
    for biases, ones for norms. Deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() == 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
                continue
            scale = std / math.sqrt(2 * depth) if name.endswith(
                ("o_proj.weight", "down_proj.weight")) else std
            noise = torch.randn(param.shape, generator=gen) * scale
            param.copy_(noise.to(device=param.device, dtype=param.dtype))

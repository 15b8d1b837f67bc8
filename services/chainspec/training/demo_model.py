"""The model being trained: chainspec's TargetModel plus K MTP modules, sharing the
embedding and the LM head (tied to each other as well)."""

from __future__ import annotations

import math

import torch
from torch import nn

from chainspec.models.config import ModelConfig
from chainspec.models.mtp import MTPDraftModel, MTPGlue
from chainspec.models.target import TargetModel

# DeepSeek glue: concat [emb, hidden], plain RMSNorm weights.
DEEPSEEK_GLUE = MTPGlue(hidden_first=False, unit_offset_norms=False)


class DemoModel(nn.Module):
    def __init__(self, cfg: ModelConfig, num_mtp: int) -> None:
        super().__init__()
        self.config = cfg
        self.target = TargetModel(cfg)
        self.draft = MTPDraftModel(cfg, num_mtp, DEEPSEEK_GLUE)
        # NOTE: shared modules, not copies: the drafter reads the target's embedding/head.
        self.draft.embed_tokens = self.target.model.embed_tokens
        self.draft.lm_head = self.target.lm_head

    @property
    def num_mtp(self) -> int:
        return self.draft.num_modules

    def mtp_parameters(self) -> list[nn.Parameter]:
        return list(self.draft.mtp.parameters())

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Normal(0, std) for matrices (residual outputs scaled by 1/sqrt(2 * depth)),
        ones for norms. Deterministic for a seed."""
        gen = torch.Generator().manual_seed(seed)
        depth = self.config.num_layers + self.num_mtp
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.dim() == 1:
                    param.fill_(1.0)
                    continue
                scale = std / math.sqrt(2 * depth) if name.endswith(
                    ("o_proj.weight", "down_proj.weight")) else std
                param.copy_(torch.randn(param.shape, generator=gen) * scale)

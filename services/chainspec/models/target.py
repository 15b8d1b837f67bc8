"""The target decoder: a Llama-family causal LM over packed rows.

`forward` returns the exported hidden states h (after the final norm, the tensor the LM
head reads); `logits` applies the head separately so callers compute logits only for the
rows they need.
"""

from __future__ import annotations

import torch
from torch import nn

from chainspec.models.config import ModelConfig
from chainspec.models.layers import AttentionBackend, DecoderLayer, RMSNorm
from chainspec.models.rope import RotaryEmbedding


class DecoderStack(nn.Module):
    """`model.*` in HF naming: embedding, layers, final norm."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_len: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position, cache_len)
        self.model = DecoderStack(cfg, self.rotary)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_scale(self) -> float:
        return self.config.head_dim ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states after the final norm [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, backend)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, vocab]."""
        return self.lm_head(hidden)

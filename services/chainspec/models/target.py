"""The target decoder over packed rows: a family's stack of layers (DESIGN 2.4).

`forward` returns the exported hidden states h (after the final norm, the tensor the LM
head reads); `logits` applies the head separately so callers compute logits only for the
rows they need. Each layer is an attention kind and an MLP kind; `cache_specs` says what
each keeps between steps, which is all the engine needs to know about them.
"""

from __future__ import annotations

import torch
from torch import nn

from chainspec.models.cache_spec import CacheSpec
from chainspec.models.config import ModelConfig
from chainspec.models.layers import AttentionBackend


class DecoderStack(nn.Module):
    """`model.*` in HF naming: embedding, layers, final norm."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_len: int | None = None) -> None:
        super().__init__()
        from chainspec.models.families import family_for
        self.config = cfg
        self.family = family_for(cfg.architecture)
        parts = self.family.build(cfg, cache_len)
        self.rotaries = nn.ModuleList(parts.rotaries)  # shared tables, moved with the model
        self.model = DecoderStack(cfg, parts.layers, parts.norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_scale(self) -> float:
        """The default scale of dense backends (each layer passes its own)."""
        return self.config.head_dim ** -0.5

    @property
    def graph_safe(self) -> bool:
        """Whether a captured CUDA graph may replay a step: no layer reads host-side step
        data (a module says so with `graph_safe = False`; the default is True)."""
        return all(getattr(m, "graph_safe", True) for m in self.model.layers.modules())

    def cache_specs(self) -> list[CacheSpec]:
        """One per layer, in layer order (the index is the layer's cache layer)."""
        return [layer.cache_spec() for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] -> the exported hidden states [T, hidden]: after the
        final norm, or before it where the family's MTP reads that (`hidden_before_norm`)."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, backend)
        return x if self.family.hidden_before_norm else self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] (as `forward` exports it) -> [T, vocab]."""
        if self.family.hidden_before_norm:
            hidden = self.model.norm(hidden)
        return self.lm_head(hidden)

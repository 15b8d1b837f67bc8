"""Multi-token-prediction modules (DeepSeek-V3 section 2.2) and the drafter's model.

Module k at row p:  u = concat(enorm(Emb(x[p+k])), hnorm(g[k-1][p]))   (order per family)
                    g[k][p] = Block(eh_proj(u))                        (own KV cache)
                    logits  = LMHead(final_norm(g[k][p]))              (predicts x[p+k+1])
with g[0] = h, the target's exported hidden state. Chain mode feeds step k the g[k-1] of
this round; non-chain mode feeds every step h. K steps use L modules: step k runs module
(k-1) mod L, and each *step* has its own KV cache layer (step k-1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from chainspec.kernels.mtp_input import fused_mtp_input
from chainspec.models.cache_spec import CacheSpec
from chainspec.models.config import ModelConfig
from chainspec.models.layers import AttentionBackend, RMSNorm

if TYPE_CHECKING:
    from chainspec.models.families.base import MTPBlock


@dataclass(frozen=True)
class MTPGlue:
    """How a checkpoint family wires an MTP module around the shared block."""

    hidden_first: bool = False  # concat order: [hidden, emb] (MiMo) vs [emb, hidden]
    unit_offset_norms: bool = False  # norms scale by (1 + w) (Qwen3-Next)
    chains: bool = True  # step k reads g[k-1]; False: every step reads h (MiMo-V2-Flash)
    chains_normed: bool = False  # the chained g[k-1] passes step k-1's final norm (Qwen3.5)
    own_heads: bool = False  # each module has its own LM head (Step-3.5's shared_head.output)


class MTPModule(nn.Module):
    """One MTP module. Attribute names are the canonical (DeepSeek) ones; adapters map
    other families' tensor names onto them."""

    def __init__(self, cfg: ModelConfig, block: nn.Module, glue: MTPGlue) -> None:
        super().__init__()
        h, eps, offset = cfg.hidden_size, cfg.rms_eps, glue.unit_offset_norms
        self.enorm = RMSNorm(h, eps, offset)
        self.hnorm = RMSNorm(h, eps, offset)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = block  # the family's MTP decoder layer (its attention kind)
        self.final_norm = RMSNorm(h, eps, offset)
        if glue.own_heads:
            self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.hidden_first = glue.hidden_first

    def forward(self, token_emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """token_emb, hidden [T, H] -> g [T, H], the block output before final_norm."""
        # enorm + hnorm + concat: one Triton kernel on CUDA, RMSNorm in torch elsewhere
        u = fused_mtp_input(token_emb, hidden, self.enorm.weight, self.hnorm.weight,
                            self.enorm.eps, self.enorm.unit_offset, self.hidden_first)  # [T, 2H]
        return self.block(self.eh_proj(u), positions, backend)


class _StepLayer:
    """Routes a module's attention to the KV layer of the draft step it is serving."""

    def __init__(self, backend: AttentionBackend, layer: int) -> None:
        self.backend, self.layer = backend, layer

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               **options) -> torch.Tensor:
        del layer
        return self.backend.attend(self.layer, q, k, v, **options)

    def recurrent(self, layer: int):
        del layer
        return self.backend.recurrent(self.layer)


class MTPDraftModel(nn.Module):
    """What the drafter loads: shared embedding and LM head plus L MTP modules."""

    def __init__(self, cfg: ModelConfig, num_modules: int, glue: MTPGlue,
                 cache_len: int | None = None,
                 block: Callable[[ModelConfig, int | None], MTPBlock] | None = None) -> None:
        """`block`: the family's MTP decoder layer (default: a Llama-family layer)."""
        super().__init__()
        if num_modules < 1:
            raise ValueError("an MTP draft model needs at least one module")
        if block is None:
            from chainspec.models.families.llama import mtp_block as block
        self.config = cfg
        self.glue = glue
        blocks = [block(cfg, cache_len) for _ in range(num_modules)]
        # NOTE: registered here so they move with the model; no state (non-persistent)
        self.rotaries = nn.ModuleList(r for b in blocks for r in b.rotaries)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg, b.layer, glue) for b in blocks)

    @property
    def rotary(self) -> nn.Module:
        """The first module's rotary table."""
        return self.rotaries[0]

    def cache_specs(self, num_steps: int) -> list[CacheSpec]:
        """One KV layer per draft step, shaped by the step's module."""
        return [self.module_for_step(k).block.cache_spec() for k in range(1, num_steps + 1)]

    @property
    def num_modules(self) -> int:
        return len(self.mtp)

    def module_for_step(self, step: int) -> MTPModule:
        """Step k (1-based) uses module (k-1) mod L."""
        return self.mtp[(step - 1) % len(self.mtp)]

    def step(self, step: int, tokens: torch.Tensor, prev: torch.Tensor,
             positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """Run draft step k over packed rows.

        tokens [T]: x[p+k] per row; prev [T, H]: g[k-1] (chain) or h (non-chain).
        Returns g[k] [T, H]. Writes KV layer k-1 of `backend`'s cache.
        """
        module = self.module_for_step(step)
        emb = self.embed_tokens(tokens)
        return module(emb, prev, positions, _StepLayer(backend, step - 1))

    def next_input(self, step: int, g: torch.Tensor, h: torch.Tensor, chain: bool = True
                   ) -> torch.Tensor:
        """What step k+1 reads after step k (k = `step`) wrote g [T, H]: g, or g through
        step k's final norm where the family chains normed states, or h when it does not
        chain (or `chain` is off). The one rule for drafting, training and the oracle."""
        if not (chain and self.glue.chains):
            return h
        return self.module_for_step(step).final_norm(g) if self.glue.chains_normed else g

    def logits(self, step: int, g: torch.Tensor) -> torch.Tensor:
        """g [T, H] -> [T, vocab], through step k's module final norm and the shared head
        (the module's own head where the family has one)."""
        module = self.module_for_step(step)
        head = module.head if self.glue.own_heads else self.lm_head
        return head(module.final_norm(g))

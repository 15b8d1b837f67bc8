"""One draft round over a `DraftBatch`: K chained MTP steps. The only step function;
the eager path and the CUDA-graph path both call it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chainspec.engine.draft_batch import DraftBatch
from chainspec.models.attention import PagedAttention
from chainspec.models.kv_cache import KVCache
from chainspec.models.mtp import MTPDraftModel


@dataclass(frozen=True)
class DraftOutput:
    tokens: torch.Tensor  # [S, K] int64
    support: torch.Tensor  # [S, K, k] int64: top-k of the draft distribution
    probs: torch.Tensor  # [S, K, k] float32: q over `support` (renormalized)


def propose(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft tokens from logits [S, V]: greedy where temperature is 0, else sampled from
    the top-k-truncated distribution with Exp(1) noise [S, k]. No host sync."""
    k = noise.shape[-1]
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    top_logits, support = (logits.float() / temp[:, None]).topk(k, dim=-1)  # [S, k]
    probs = torch.softmax(top_logits, dim=-1)
    pick = (probs / noise).argmax(dim=-1, keepdim=True)  # [S, 1]
    sampled = support.gather(1, pick).squeeze(1)
    token = torch.where(greedy, support[:, 0], sampled)
    return token, support, probs


def draft_round(model: MTPDraftModel, cache: KVCache, batch: DraftBatch, num_steps: int,
                chain: bool) -> DraftOutput:
    """Run steps 1..K. Step k reads tokens[row_tok + k - 1] and g[k-1] (chain) or h, and
    writes its draft at tokens[last_tok + k] for step k+1 to read."""
    backend = PagedAttention(cache, batch.attn, model.config.head_dim ** -0.5)
    positions = batch.attn.positions
    prev = batch.hidden  # [T, H]: g[0] = h
    drafts, supports, probs = [], [], []
    for step in range(1, num_steps + 1):
        tokens = batch.tokens[batch.row_tok + (step - 1)]  # [T]
        g = model.step(step, tokens, prev, positions, backend)  # [T, H]
        logits = model.logits(step, g[batch.last_row])  # [S, V]
        token, support, prob = propose(logits, batch.temperature, batch.noise[:, step - 1])
        batch.tokens.index_copy_(0, batch.last_tok + step, token)
        drafts.append(token)
        supports.append(support)
        probs.append(prob)
        prev = g if chain else batch.hidden
    return DraftOutput(torch.stack(drafts, 1), torch.stack(supports, 1), torch.stack(probs, 1))

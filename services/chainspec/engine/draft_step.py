"""One draft round over a `DraftBatch`: K chained MTP steps. The only step function;
the eager path and the CUDA-graph path both call it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chainspec.engine.draft_batch import DraftBatch
from chainspec.engine.sampling import draft_topk
from chainspec.engine.step_clock import StepClock
from chainspec.models.attention import PagedAttention
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.mtp import MTPDraftModel


@dataclass(frozen=True)
class DraftOutput:
    tokens: torch.Tensor  # [S, K] int64
    support: torch.Tensor  # [S, K, k] int64: top-k of the draft distribution
    probs: torch.Tensor  # [S, K, k] float32: q over `support` (renormalized)
    chain: torch.Tensor  # [S, K, H]: g[k] at each sequence's last row (draft-ahead input)


def draft_round(model: MTPDraftModel, cache: ModelKVCache, batch: DraftBatch, num_steps: int,
                chain: bool, top_k: int, clock: StepClock | None = None) -> DraftOutput:
    """Run steps 1..K. Step k reads tokens[row_tok + k - 1] and g[k-1] (chain) or h, and
    writes its draft at tokens[last_tok + k] for step k+1 to read. `clock` (never while
    capturing a graph) is marked before the first step and after each."""
    if clock is not None:
        clock.mark()
    backend = PagedAttention(cache, batch.attn, model.config.head_dim ** -0.5)
    positions = batch.attn.positions
    prev = batch.hidden  # [T, H]: g[0] = h
    drafts, supports, probs, lasts = [], [], [], []
    for step in range(1, num_steps + 1):
        tokens = batch.tokens[batch.row_tok + (step - 1)]  # [T]
        g = model.step(step, tokens, prev, positions, backend)  # [T, H]
        last = g[batch.last_row]  # [S, H]
        lasts.append(last)
        logits = model.logits(step, last)  # [S, V]
        if batch.any_sampled:
            draft_pos = batch.attn.positions[batch.last_row] + 1 + step  # [S]: d'_k's position
            token, support, prob = draft_topk(logits, batch.temperature, batch.seed,
                                              draft_pos, top_k)
        else:  # all greedy: the top token, no distribution to report
            token = logits.argmax(dim=-1)
            support = prob = None
        batch.tokens.index_copy_(0, batch.last_tok + step, token)
        drafts.append(token)
        supports.append(support)
        probs.append(prob)
        prev = model.next_input(step, g, batch.hidden, chain)
        if clock is not None:
            clock.mark()
    tokens = torch.stack(drafts, 1)  # [S, K]
    states = torch.stack(lasts, 1)  # [S, K, H]
    if not batch.any_sampled:
        empty = tokens.new_zeros(*tokens.shape, top_k)
        return DraftOutput(tokens, empty, empty.float(), states)
    return DraftOutput(tokens, torch.stack(supports, 1), torch.stack(probs, 1), states)

"""From-scratch draft reference (DESIGN 3.2): all modules over the whole committed prefix,
dense causal attention, no KV cache, no windows."""

from __future__ import annotations

import torch

from chainspec.models.attention import DenseCausal
from chainspec.models.mtp import MTPDraftModel


def reference_drafts(model: MTPDraftModel, tokens: list[int], hidden: torch.Tensor,
                     num_steps: int, chain: bool) -> tuple[list[int], list[torch.Tensor]]:
    """tokens x[0..N'] (x[N'] the newest), hidden h[0..N'-1] -> drafts d'_1..d'_K and the
    last-row logits of each step."""
    drafts, logits, _ = reference_round(model, tokens, hidden, num_steps, chain)
    return drafts, logits


@torch.no_grad()
def reference_round(model: MTPDraftModel, tokens: list[int], hidden: torch.Tensor,
                    num_steps: int, chain: bool, forced: list[int] | None = None
                    ) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """`reference_drafts`, plus g[1..K] at the last row ([K, H]). `forced`: the tokens
    each step's output is taken to be (sampled drafts) instead of its argmax."""
    n = hidden.shape[0]
    assert len(tokens) == n + 1
    positions = torch.arange(n)
    stream = list(tokens)
    prev, drafts, all_logits, states = hidden, [], [], []
    for k in range(1, num_steps + 1):
        ids = torch.tensor(stream[k: k + n])  # x[p+k] for p = 0..n-1
        g = model.step(k, ids, prev, positions, DenseCausal(1, n, model.config.head_dim ** -0.5))
        states.append(g[-1])
        logits = model.logits(k, g[-1:])[0]
        draft = int(logits.argmax()) if forced is None else forced[k - 1]
        drafts.append(draft)
        all_logits.append(logits)
        stream.append(draft)
        prev = g if chain else hidden
    return drafts, all_logits, torch.stack(states)

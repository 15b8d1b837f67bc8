"""Training text the frozen target writes itself: each prompt continued by sampling the
target's own distribution (temperature 1), so the drafter learns the distribution it will
be asked to predict, not a corpus'."""

from __future__ import annotations

import torch

from chainspec.models.attention import DenseCausal
from chainspec.models.target import TargetModel


@torch.no_grad()
def continue_prompt(target: TargetModel, prompt: list[int], new_tokens: int,
                    eos: tuple[int, ...], generator: torch.Generator) -> list[int]:
    """prompt + up to `new_tokens` sampled tokens (stops after an EOS)."""
    # NOTE: full recompute per token (no KV cache): O(n^2), fine for the few hundred
    # tokens per prompt this makes; the serving engine is the fast path.
    device = target.lm_head.weight.device
    tokens = list(prompt)
    limit = min(len(prompt) + new_tokens, target.config.max_position)
    while len(tokens) < limit:
        ids = torch.tensor(tokens, device=device)
        backend = DenseCausal(1, len(tokens), target.attention_scale)
        hidden = target(ids, torch.arange(len(tokens), device=device), backend)[-1:]
        probs = target.logits(hidden).float().softmax(-1).cpu()  # [1, V]
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
        if tokens[-1] in eos:
            break
    return tokens


def continue_prompts(target: TargetModel, prompts: list[list[int]], new_tokens: int,
                     eos: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [continue_prompt(target, p, new_tokens, eos, generator) for p in prompts if p]

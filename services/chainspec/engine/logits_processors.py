"""Logits processing over verify windows (DESIGN 4.2): logit_bias, min_tokens, then the
presence, frequency and repetition penalties (vLLM's order), batched over B windows of
K+1 rows, before acceptance, so greedy argmax and the sampled p both see the processed
distribution. min_p is applied with temperature in `sampling.target_probs`.

History rule: row r of a window decides the token at position N+1+r, so it sees the
committed tokens x[0..N] plus drafts d_1..d_r (the drafts before the token it decides);
rows past num_drafts are padding and never read. That is exactly the history plain
decoding has at that position when the drafts are accepted, so speculation cannot change
the processed distribution of any committed token.

Semantics: presence/frequency penalties count generated tokens only (OpenAI):
`logit -= frequency * count + presence * (count > 0)`. The repetition penalty (HF/vLLM)
covers prompt + generated tokens: seen logits > 0 are divided by it, others multiplied.
min_tokens masks EOS (unless ignore_eos) and stop_token_ids to -inf while fewer than
min_tokens tokens were generated before the row's token.

Finiteness: with SamplingParams' bounds a processed logit is finite or -inf (masked).
As a backstop against a model's overflow, +inf becomes float32's largest value and NaN
-inf (that token is never chosen), so no NaN reaches acceptance or logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chainspec.engine.sampling import SamplingParams

_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class WindowRequest:
    """What processing needs of one deciding request: its committed tokens split into
    prompt and generated, and the token ids min_tokens holds back."""

    params: SamplingParams
    prompt: Sequence[int]
    generated: Sequence[int]
    stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids


@dataclass(frozen=True)
class LogitsProcessing:
    """Per-batch tensors of B windows. Optional parts are None when no request uses them."""

    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32 (1 = off)
    generated: torch.Tensor  # [B] int64: tokens generated before row 0
    counts: torch.Tensor | None  # [B, V] float32: generated-token counts (penalties)
    prompt_seen: torch.Tensor | None  # [B, V] bool: tokens of the prompt (repetition)
    bias: torch.Tensor | None  # [B, V] float32 (logit_bias)
    min_tokens: torch.Tensor | None  # [B] int64
    stop_mask: torch.Tensor | None  # [B, V] bool: ids min_tokens masks

    @classmethod
    def build(cls, reqs: Sequence[WindowRequest], vocab: int, device: torch.device | str
              ) -> LogitsProcessing | None:
        """None when no request of the batch processes logits (they pay nothing)."""
        params = [r.params for r in reqs]
        if not any(p.processes_logits for p in params):
            return None

        def per_req(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        penalized = any(p.presence_penalty or p.frequency_penalty or
                        p.repetition_penalty != 1.0 for p in params)
        repeat = any(p.repetition_penalty != 1.0 for p in params)
        min_tok = any(p.min_tokens > len(r.generated) for p, r in
                      zip(params, reqs, strict=True))
        return cls(
            per_req([p.presence_penalty for p in params]),
            per_req([p.frequency_penalty for p in params]),
            per_req([p.repetition_penalty for p in params]),
            per_req([len(r.generated) for r in reqs], torch.int64),
            token_counts([r.generated for r in reqs], vocab, device) if penalized else None,
            token_counts([r.prompt for r in reqs], vocab, device) > 0 if repeat else None,
            _dense([p.logit_bias for p in params], vocab, device)
            if any(p.logit_bias for p in params) else None,
            per_req([p.min_tokens for p in params], torch.int64) if min_tok else None,
            _dense([[(t, 1.0) for t in r.stop_ids] for r in reqs], vocab, device) > 0
            if min_tok else None)

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
              ) -> torch.Tensor:
        """logits [B, K+1, V]; drafts [B, K]; num_drafts [B] -> processed logits
        [B, K+1, V] float32 (a new tensor)."""
        logits = logits.float()
        if self.bias is not None:
            logits = logits + self.bias[:, None, :]
        if self.min_tokens is not None:
            logits = apply_min_tokens(logits, self.stop_mask, self.generated, self.min_tokens)
        if self.counts is not None:
            counts = window_counts(self.counts, drafts, num_drafts)  # [B, K+1, V]
            logits = apply_penalties(logits, counts, self.prompt_seen, self.presence,
                                     self.frequency, self.repetition)
        return logits.nan_to_num(nan=-math.inf, posinf=_FLOAT32_MAX, neginf=-math.inf)


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int,
                 device: torch.device | str) -> torch.Tensor:
    """Occurrences of each token id per list: [B, V] float32 (one scatter_add).
    NOTE: rebuilt from the host's token lists each step: O(tokens) of host work and one
    host-to-device copy, no sync."""
    flat = [t for tokens in token_lists for t in tokens]
    rows = torch.repeat_interleave(torch.arange(len(token_lists)),
                                   torch.tensor([len(t) for t in token_lists], dtype=torch.long))
    counts = torch.zeros(len(token_lists) * vocab, dtype=torch.float32, device=device)
    index = (rows * vocab + torch.tensor(flat, dtype=torch.long)).to(device)
    return counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32)
                               ).view(len(token_lists), vocab)


def window_counts(counts: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> torch.Tensor:
    """Per-row history counts: row r = counts + one-hot(d_1..d_r) for the real drafts.
    counts [B, V]; drafts [B, K] (0-based: drafts[:, i] is d_{i+1}); num_drafts [B] ->
    [B, K+1, V] float32."""
    b, k = drafts.shape
    v = counts.shape[-1]
    valid = (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]) & (
        drafts >= 0) & (drafts < v)  # [B, K]
    steps = torch.zeros(b, k + 1, v, dtype=torch.float32, device=counts.device)
    # d_{i+1} enters the history of rows i+1.. (the rows after the one that judges it)
    steps[:, 1:].scatter_add_(-1, drafts.clamp(0, v - 1)[..., None],
                              valid[..., None].float())
    return counts[:, None, :] + steps.cumsum(dim=1)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor,
                    prompt_seen: torch.Tensor | None, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits, counts [B, R, V]; prompt_seen [B, V] bool or None; presence, frequency,
    repetition [B] -> [B, R, V]."""
    seen = counts > 0  # [B, R, V]
    rep = repetition[:, None, None]
    if prompt_seen is not None:
        seen_any = seen | prompt_seen[:, None, :]
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen_any, scaled, logits)
    return logits - frequency[:, None, None] * counts - presence[:, None, None] * seen


def apply_min_tokens(logits: torch.Tensor, stop_mask: torch.Tensor, generated: torch.Tensor,
                     min_tokens: torch.Tensor) -> torch.Tensor:
    """Row r's token is generated token number generated + r (0-based): while that is
    below min_tokens, stop ids are -inf. logits [B, R, V]; stop_mask [B, V];
    generated, min_tokens [B]."""
    rows = torch.arange(logits.shape[1], device=logits.device)  # [R]
    early = generated[:, None] + rows[None, :] < min_tokens[:, None]  # [B, R]
    return logits.masked_fill(early[..., None] & stop_mask[:, None, :], -math.inf)


def _dense(pairs: Sequence[Sequence[tuple[int, float]]], vocab: int,
           device: torch.device | str) -> torch.Tensor:
    """Sparse (token, value) pairs per request -> [B, V] float32 (zeros elsewhere)."""
    out = torch.zeros(len(pairs), vocab, dtype=torch.float32)
    for i, items in enumerate(pairs):
        if items:
            ids, values = zip(*items, strict=True)
            out[i, list(ids)] = torch.tensor(values, dtype=torch.float32)
    return out.to(device)

"""Log-probabilities of committed tokens, from the target's distribution at their rows.

Which distribution: log_softmax of the target's logits AFTER logits processing
(logit_bias, min_tokens, penalties) and BEFORE temperature, min-p, top-k and top-p
(vLLM's "processed_logprobs"; vLLM's default, "raw_logprobs", is the unprocessed model's).
A committed token's row has exactly plain decoding's history (logits_processors), so
speculation does not change these values beyond float noise.

Every value is finite: a token the processing masked (min_tokens) has logprob -inf, which
is floored to LOGPROB_FLOOR (vLLM's -9999.0), and a NaN (a non-finite logit) becomes the
floor too, so no client ever reads NaN or Infinity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROB_FLOOR = -9999.0  # vLLM's floor for -inf logprobs

@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability and the top alternatives at its row."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


@dataclass(frozen=True)
class WindowLogprobs:
    """Device tensors of B windows of K+1 rows: row r holds the token committed at r."""

    chosen: torch.Tensor  # [B, K+1] float32
    top_ids: torch.Tensor  # [B, K+1, N] int64
    top_values: torch.Tensor  # [B, K+1, N] float32


def window_logprobs(logits: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor,
                    next_token: torch.Tensor, top_n: int) -> WindowLogprobs:
    """logits [B, K+1, V] (processed, pre-temperature); drafts [B, K]; accepted [B];
    next_token [B] -> logprobs of the committed tokens d_1..d_a, next at rows 0..a (rows
    past a hold padding). No host sync."""
    logp = finite_logprobs(logits.float().log_softmax(dim=-1))  # [B, K+1, V]
    b, rows, v = logp.shape
    tokens = torch.cat([drafts.clamp(0, v - 1), drafts.new_zeros(b, 1)], dim=1)  # [B, K+1]
    tokens = tokens.scatter(1, accepted[:, None], next_token[:, None])
    chosen = logp.gather(-1, tokens[..., None]).squeeze(-1)  # [B, K+1]
    values, ids = logp.topk(min(top_n, v), dim=-1) if top_n else (
        logp.new_zeros(b, rows, 0), tokens.new_zeros(b, rows, 0))
    return WindowLogprobs(chosen, ids, values)


def finite_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """logp with -inf and NaN at LOGPROB_FLOOR and everything in [LOGPROB_FLOOR, 0]."""
    return logp.nan_to_num(nan=LOGPROB_FLOOR, posinf=0.0, neginf=LOGPROB_FLOOR).clamp(
        LOGPROB_FLOOR, 0.0)


def host_logprobs(window: WindowLogprobs, item: int, tokens: list[int], top_n: int
                  ) -> tuple[TokenLogprob, ...]:
    """The TokenLogprobs of window `item`'s committed `tokens` (rows 0..len-1), each with
    its top `top_n` alternatives. Expects host tensors."""
    chosen = window.chosen[item].tolist()
    ids = window.top_ids[item, :, :top_n].tolist()
    values = window.top_values[item, :, :top_n].tolist()
    return tuple(TokenLogprob(t, chosen[r], tuple(zip(ids[r], values[r], strict=True)))
                 for r, t in enumerate(tokens))

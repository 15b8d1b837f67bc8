"""Draft-ahead (DESIGN 4.8): proposals for the likely outcome of a round still being
verified, so that a verifier with a hit starts its next round without waiting.

After a round drafted for bonus index N', the verifier will verify m drafts v_1..v_m
(the drafter's own, or look-ahead drafts it already holds). The likely verdict is "all
accepted", then a bonus the drafter can guess. The look-ahead window is the sequence's
history rows (exact), then m rows standing for positions N'..N'+m-1 with tokens
v_1..v_m and, in place of the target hidden states h[N'+i] the drafter does not have
yet, its own chain states g[i+1] at row N'-1 (g[k] at row p is trained to predict
x[p+k+1], as h[p+k] does). One ordinary draft round over that window gives, at its last
row, step 1 -> the bonus guess b (for x[N'+m+1]) and steps 2..K -> K-1 drafts after it.
The entry is keyed by (N', v_1..v_m, b); the verifier uses it only on an exact match.

Exactness: a look-ahead writes the MTP caches only at positions >= N'-(K-1), which the
next exact update's window (its history rows start there) rewrites before any row reads
them; the sequence's history rows and expected start are left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chainspec.engine.draft_batch import Window
from chainspec.engine.draft_step import DraftOutput
from chainspec.engine.draft_types import DraftAhead, DraftResult


@dataclass(frozen=True)
class AheadSource:
    """What a look-ahead for one sequence starts from (taken when its round drafted)."""

    seq_id: int
    base: int  # N': the bonus index of the round being verified
    verify: torch.Tensor  # [m] int64: the drafts that round verifies
    chain: torch.Tensor  # [K, H]: g[1..K] at row N'-1
    temperature: float
    seed: int


def ahead_window(src: AheadSource, blocks: tuple[int, ...], hist_hidden: torch.Tensor | None,
                 hist_tokens: torch.Tensor | None) -> Window:
    """History rows, then the m hypothetical rows N'..N'+m-1."""
    m = src.verify.shape[0]
    hidden, tokens = src.chain[:m], src.verify  # [m, H], [m]
    if hist_hidden is not None:
        hidden = torch.cat([hist_hidden, hidden.to(hist_hidden.dtype)])
        tokens = torch.cat([hist_tokens, tokens])
    first = src.base - (0 if hist_hidden is None else hist_hidden.shape[0])
    return Window(blocks, first, hidden, tokens, src.temperature, src.seed)


def ahead_entry(src: AheadSource, out: DraftOutput, row: int, sampled: bool) -> DraftAhead:
    """Row `row` of a look-ahead round as an entry: step 1 is the bonus guess, steps
    2..K the drafts that follow it."""
    tokens = out.tokens[row].cpu()  # [K]
    outcome = (*src.verify.tolist(), int(tokens[0]))
    position = src.base + len(outcome)
    if sampled:
        drafts = DraftResult(src.seq_id, position, tokens[1:].clone(),
                             out.support[row, 1:].cpu(), out.probs[row, 1:].float().cpu())
    else:
        drafts = DraftResult(src.seq_id, position, tokens[1:].clone())
    return DraftAhead(src.seq_id, src.base, outcome, drafts)

"""The grammar mask over a step's verify windows (DESIGN 4.13), after logits processing and
before acceptance, so greedy argmax and the sampled p both see the masked distribution.

History rule (as `engine/logits_processors.py`): row r of a window decides the token at
position N+1+r, so its mask is what the grammar allows after the committed output and
drafts d_1..d_r. The request's matcher consumes the drafts row by row (`fill_window`),
then, once acceptance is known, rolls back the rejected ones and takes the step's last
token (`settle`): between steps it holds exactly the committed output. A draft the
grammar refuses is masked at the row that judges it, so it is never accepted: the
drafter needs no grammar. Plain decoding is the window with no drafts, so plain and
speculative decoding mask every committed token alike: lossless by construction.

A row left with no token (min_tokens masking the EOS a complete grammar needs) falls back
to the grammar's mask over the unprocessed logits: the grammar outranks min_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from chainspec.engine.grammar import GrammarMatcher


class GrammarMasks:
    """Bitmasks of one step's grammar windows, on the host: [B, K+1, W] int32 (all ones,
    i.e. no constraint, for the windows without a grammar)."""

    def __init__(self, matchers: Sequence[GrammarMatcher | None],
                 drafts: Sequence[Sequence[int]], rows: int, vocab: int) -> None:
        self.matchers = list(matchers)
        self.vocab = vocab
        self.bitmask = torch.full((len(matchers), rows, (vocab + 31) // 32), -1,
                                  dtype=torch.int32)  # [B, K+1, W]
        self.consumed = [m.fill_window(d, self.bitmask[i]) if m is not None else 0
                         for i, (m, d) in enumerate(zip(self.matchers, drafts, strict=True))]

    @classmethod
    def build(cls, matchers: Sequence[GrammarMatcher | None], drafts: Sequence[Sequence[int]],
              rows: int, vocab: int) -> GrammarMasks | None:
        """None when no window has a grammar (they pay nothing)."""
        if all(m is None for m in matchers):
            return None
        return cls(matchers, drafts, rows, vocab)

    def apply(self, logits: torch.Tensor, raw: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, K+1, V] float32 -> masked logits (a new tensor). `raw`: the logits
        before processing, for rows that processing and the grammar leave empty."""
        b, r, v = logits.shape
        out = logits.float().clone().view(b * r, v)  # NOTE: the in-place kernel needs 2D
        rows = [i * r + j for i, m in enumerate(self.matchers) if m is not None
                for j in range(r)]
        bitmask = self.bitmask.view(b * r, -1).to(logits.device, non_blocking=True)
        _apply_bitmask(out, bitmask, rows, v)
        out = out.view(b, r, v)
        if raw is None:
            return out
        fallback = raw.float().clone().view(b * r, v)
        _apply_bitmask(fallback, bitmask, rows, v)
        empty = torch.isneginf(out).all(dim=-1, keepdim=True)  # [B, K+1, 1]
        return torch.where(empty, fallback.view(b, r, v), out)

    def settle(self, verdicts: Sequence[tuple[int, int]]) -> None:
        """(accepted, next token) per window, after the host sync."""
        for m, consumed, (accepted, nxt) in zip(self.matchers, self.consumed, verdicts,
                                                strict=True):
            if m is not None:
                m.settle(consumed, accepted, nxt)


def guide_drafts(requests: Sequence) -> None:
    """Structured output's drafts (DESIGN 4.13): each grammar request's drafts end at the
    first the grammar refuses (which stays, to be rejected), and where the grammar forces
    text its tokens replace the rest (`GrammarMatcher.guide`), as point masses in q.
    NOTE: drafts change speed only (acceptance decides every token), and a forced draft
    is a deterministic proposal, so Leviathan's rule stays exact with q = 1 at it."""
    for req in requests:
        d = req.drafts
        if req.grammar is None or d is None or d.tokens.shape[0] == 0:
            continue
        drafted = d.tokens.tolist()
        tokens, forced = req.grammar.guide(drafted)
        if tokens == drafted:
            continue
        n = len(tokens)
        support, probs = (None, None) if d.support is None else \
            (d.support[:n].clone(), d.probs[:n].clone())  # [n, k]
        for i, is_forced in enumerate(forced):
            if is_forced and support is not None:
                support[i] = tokens[i]
                probs[i] = 0.0
                probs[i, 0] = 1.0
        req.drafts = replace(d, tokens=torch.tensor(tokens, dtype=torch.int64),
                             support=support, probs=probs)


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                   vocab: int) -> None:
    """Forbidden tokens of `rows` to -inf, in place: xgrammar's kernel (CPU, CUDA)."""
    from xgrammar import apply_token_bitmask_inplace
    apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)

"""Choosing the rows of one verifier step: verify windows, plain decode rows, prefill
chunks, under a token budget."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from chainspec.engine.request import Request


class WorkKind(enum.Enum):
    PREFILL = "prefill"  # a prompt chunk; the last chunk also samples the first token
    VERIFY = "verify"  # x[N] and the drafts d1..dk (k may be 0: a plain decode row)


@dataclass(frozen=True)
class Work:
    request: Request
    kind: WorkKind
    start: int  # position of the first row
    tokens: tuple[int, ...]  # input ids of the rows
    num_drafts: int = 0  # VERIFY: how many of `tokens` are drafts
    ahead: bool = False  # VERIFY: the drafts came from a look-ahead hit (DESIGN 4.8)

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    @property
    def samples(self) -> bool:
        """Whether this work ends in committed tokens (verify, or the last prompt chunk;
        a recompute after preemption commits nothing: its next token is known)."""
        return self.kind is WorkKind.VERIFY or (
            self.start + self.num_rows == self.request.prompt_len
            and not self.request.recompute_len)


def schedule(running: Sequence[Request], budget: int, chunk: int) -> list[Work]:
    """Decoding sequences first (one verify window each), then prefill chunks."""
    work: list[Work] = []
    for req in running:
        if req.prefilling or req.finished:
            continue
        n = req.num_computed
        drafts = req.drafts.tokens.tolist() if req.drafts is not None else []
        work.append(Work(req, WorkKind.VERIFY, n, (req.tokens[n], *drafts), len(drafts),
                         bool(drafts) and req.drafts_ahead))
        budget -= 1 + len(drafts)
    for req in running:
        if not req.prefilling or req.finished or budget <= 0:
            continue
        n = min(req.prefill_len - req.num_computed, chunk, budget)
        start = req.num_computed
        work.append(Work(req, WorkKind.PREFILL, start, tuple(req.tokens[start:start + n])))
        budget -= n
    return work

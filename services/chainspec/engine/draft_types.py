"""What the verifier and a drafter say to each other, independent of transport.

Rows follow DESIGN 3.1: an update for a sequence carries `start` = N (the first row whose
hidden state it brings), the committed tokens x[N+1 .. N+n] and the target hidden states
h[N .. N+n-1]. Row p thus arrives as the pair (h_p, x[p+1]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Per-sequence error codes; names match grpc.StatusCode members.
INVALID_ARGUMENT = "INVALID_ARGUMENT"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True)
class DraftSampling:
    """How drafts are proposed: greedy (temperature 0) or sampled from the top-k-truncated
    draft distribution at `temperature`. `seed` makes sampled drafts reproducible."""

    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"draft temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = DraftSampling()


@dataclass(frozen=True)
class SeqUpdate:
    seq_id: int
    start: int
    tokens: tuple[int, ...]  # x[start+1 .. start+n]
    hidden: torch.Tensor  # [n, H]: h[start .. start+n-1]
    want_drafts: bool = True
    sampling: DraftSampling = GREEDY


@dataclass(frozen=True)
class Drafts:
    seq_id: int
    tokens: torch.Tensor  # [K] int64
    support: torch.Tensor | None = None  # [K, k] int64, sampled drafts only
    probs: torch.Tensor | None = None  # [K, k] float32, q over `support`


@dataclass(frozen=True)
class SeqFailure:
    seq_id: int
    code: str
    message: str
    expected_start: int | None = None


DraftOutcome = Drafts | SeqFailure

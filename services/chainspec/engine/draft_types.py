"""What a verifier and a drafter say to each other, as plain values.

Transport-neutral: the in-process engine and the gRPC codec (`rpc/draft_codec`) use the
same frozen dataclasses; nothing here imports grpc or protobuf. Rows follow DESIGN 3.1: an
update carries `start` = N, the committed tokens x[N+1 .. N+n] and the target hidden
states h[N .. N+n-1], so row p arrives as the pair (h_p, x[p+1]). Field meanings follow
`protos/chainspec/v1/drafter.proto`. `__post_init__` checks shapes only (no device sync);
untrusted input is validated by the codec before it gets here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ErrorCode(enum.StrEnum):
    """Per-sequence error status, named (and valued) as the grpc.StatusCode member."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True)
class DraftSampling:
    """How drafts are drawn: greedy (temperature 0) or sampled from the top-k tokens.

    `seed` makes sampled drafts reproducible; None draws fresh randomness.
    """

    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"draft temperature must be finite and >= 0, "
                             f"got {self.temperature}")
        if self.temperature > 0 and self.top_k < 1:
            raise ValueError(f"sampled drafts need top_k >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = DraftSampling()


@dataclass(frozen=True)
class SeqUpdate:
    """New committed rows of one sequence: tokens[i] = x[start + i + 1], hidden = h[start..]."""

    seq_id: int
    start: int
    tokens: tuple[int, ...]  # [n]
    hidden: torch.Tensor  # [n, H]
    want_drafts: bool = True
    sampling: DraftSampling = GREEDY
    # Draft-ahead (DESIGN 4.8): also propose drafts for the likely outcome of the round
    # that follows this update, in a look-ahead answer (`DraftAhead`).
    look_ahead: bool = False
    # The drafts the verifier will verify after this update when it already holds them
    # (a look-ahead hit); empty: the drafts this update asks for.
    verifying: tuple[int, ...] = ()
    # Prefix caching (DESIGN 4.12, engine/prefix_cache.py): (end position, drafter key)
    # of full blocks, keyed by their chain hash and the K tokens after them. The drafter
    # caches its blocks that are final under them; an update that starts past 0 for a
    # sequence the drafter does not hold carries the keys of every block below `start`
    # (the prefix the verifier read from its cache), which the drafter reads from its own.
    cache_keys: tuple[tuple[int, bytes], ...] = ()
    # Drafter-side depth (DESIGN 4.11): at most this many drafts are wanted from the
    # round (0: K). The round runs as many draft steps as its deepest update asks.
    num_drafts: int = 0

    def __post_init__(self) -> None:
        if self.num_drafts < 0:
            raise ValueError(f"update of seq {self.seq_id}: num_drafts {self.num_drafts} < 0")
        n, shape = len(self.tokens), self.hidden.shape
        if len(shape) != 2 or shape[0] != n or n == 0:
            raise ValueError(f"update of seq {self.seq_id}: {n} tokens need hidden [n >= 1, H],"
                             f" got {list(self.hidden.shape)}")
        if self.start < 0:
            raise ValueError(f"update of seq {self.seq_id}: start {self.start} < 0")

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        """Position the next update of this sequence starts at (the new bonus index N')."""
        return self.start + len(self.tokens)

    @property
    def opens_from_cache(self) -> bool:
        """It may open the sequence past 0 from a prefix cache hit: its keys reach start."""
        return self.start > 0 and any(end == self.start for end, _ in self.cache_keys)


@dataclass(frozen=True)
class DraftResult:
    """1..K drafts following bonus position `position` (K unless the update asked for
    fewer, `SeqUpdate.num_drafts`); support/probs only when sampled."""

    seq_id: int
    position: int
    tokens: torch.Tensor  # [K] int64
    support: torch.Tensor | None = None  # [K, k] int64 token ids
    probs: torch.Tensor | None = None  # [K, k] float32, rows sum to 1
    draft_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"drafts of seq {self.seq_id}: tokens must be [K], "
                             f"got {list(self.tokens.shape)}")
        if (self.support is None) != (self.probs is None):
            raise ValueError(f"drafts of seq {self.seq_id}: support and probs go together")
        if self.support is None:
            return
        shape = (self.tokens.shape[0], self.support.shape[-1])
        if tuple(self.support.shape) != shape or tuple(self.probs.shape) != shape:
            raise ValueError(f"drafts of seq {self.seq_id}: support {list(self.support.shape)}"
                             f" and probs {list(self.probs.shape)} must both be [K, k],"
                             f" K = {self.tokens.shape[0]}")

    @property
    def sampled(self) -> bool:
        return self.support is not None


@dataclass(frozen=True)
class SeqFailure:
    """Why one sequence got no drafts; its update was dropped."""

    seq_id: int
    code: ErrorCode
    message: str
    expected_start: int | None = None  # FAILED_PRECONDITION: where the drafter can resume


SeqOutcome = DraftResult | SeqFailure


@dataclass(frozen=True)
class DraftAhead:
    """Look-ahead drafts (DESIGN 4.8): should the round that verifies at bonus index
    `base` commit exactly `outcome` (a accepted drafts, then the bonus or correction
    token), `drafts` (K, at position base + len(outcome)) are the next round's
    proposals. Drafted from the drafter's own chain states in place of target hidden
    states, so they are a guess; the verifier uses them only on an exact match and
    verifies them as usual. A sequence gets several, one per hypothesis, best first."""

    seq_id: int
    base: int
    outcome: tuple[int, ...]  # [a + 1], 0 <= a <= m
    drafts: DraftResult

    def __post_init__(self) -> None:
        if len(self.outcome) < 1 or self.drafts.position != self.base + len(self.outcome):
            raise ValueError(f"look-ahead of seq {self.seq_id}: outcome of "
                             f"{len(self.outcome)} tokens from base {self.base} does not "
                             f"lead to drafts at {self.drafts.position}")


def by_sequence(entries: Sequence[DraftAhead]) -> dict[int, tuple[DraftAhead, ...]]:
    """One look-ahead answer's entries per sequence, their order (rank) kept."""
    out: dict[int, list[DraftAhead]] = {}
    for e in entries:
        out.setdefault(e.seq_id, []).append(e)
    return {seq_id: tuple(es) for seq_id, es in out.items()}


@dataclass(frozen=True)
class UpdateBatch:
    """One step's work for a drafter. Releases apply before updates."""

    batch_id: int
    updates: tuple[SeqUpdate, ...] = ()
    releases: tuple[int, ...] = ()


@dataclass(frozen=True)
class DraftReply:
    """The answer to one UpdateBatch: drafts and failures in update order."""

    batch_id: int
    results: tuple[SeqOutcome, ...] = ()
    ahead: tuple[DraftAhead, ...] = ()  # a look-ahead answer: follows the batch's answer

"""One verifier->drafter link of the draft pool (`rpc/draft_pool.py`): its state, its
stream's request queue, the sequences assigned to it and batches in flight; plus the
pool's counters and what a drafter must report to be used."""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from chainspec.rpc.draft_codec import DraftLimits
from chainspec.rpc.generated.v1 import drafter_pb2 as pb

CLOSE = object()  # ends a stream's request iterator (half-close)


@dataclass(frozen=True)
class DrafterMatch:
    """What a drafter must report in Info to be used (None: not checked)."""

    num_draft_tokens: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    weights_fingerprint: str | None = None

    def mismatch(self, info: pb.DrafterInfo) -> str | None:
        for name in ("num_draft_tokens", "hidden_size", "vocab_size", "weights_fingerprint"):
            want, got = getattr(self, name), getattr(info, name)
            if want is not None and want != got:
                return f"{name} is {got!r}, expected {want!r}"
        return None


@dataclass
class DraftPoolStats:
    """Counters for metrics (bytes are protobuf payload sizes)."""

    rounds: int = 0  # collect() calls that had batches to wait for
    wait_s_total: float = 0.0  # time collect() spent waiting for drafts
    last_wait_s: float = 0.0
    batches_sent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    late_batches: int = 0  # answered after their round deadline
    local_failures: int = 0  # updates the pool answered itself (no usable drafter)
    stream_failures: int = 0  # drafter streams that broke
    reassignments: int = 0  # sequences given to a drafter again after losing theirs
    reconnects: int = 0  # links to a wanted drafter opened again after a failure
    ahead_entries: int = 0  # look-ahead entries received (DESIGN 4.8)
    affine_hits: int = 0  # prefix hits routed to the drafter their blocks were sent to


class PoolObserver(Protocol):
    def round_trip(self, seconds: float) -> None:
        """A Draft batch was answered `seconds` after it was sent (reader thread)."""


class LinkState(enum.StrEnum):
    LIVE = "live"  # takes new sequences
    DRAINING = "draining"  # answered UNAVAILABLE: its sequences move, no new ones
    RETIRED = "retired"  # removed by set_endpoints
    DEAD = "dead"  # stream broke or never connected; retried while wanted
    CONNECTING = "connecting"  # wanted, first connection under way (reported only)


@dataclass(eq=False)
class Link:
    """One drafter endpoint: its stream, the sequences assigned to it, batches in flight."""

    endpoint: str
    state: LinkState = LinkState.DEAD
    channel: grpc.Channel | None = None
    limits: DraftLimits | None = None
    capacity: int = 0
    requests: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    seqs: set[int] = field(default_factory=set)
    pending_releases: list[int] = field(default_factory=list)
    outstanding: dict[int, tuple[float, frozenset[int]]] = field(default_factory=dict)
    open: bool = False  # the stream may still answer
    half_closed: bool = False
    failures: int = 0  # failed connects (or short-lived streams) before this link
    opened_s: float = 0.0  # time.monotonic() when the stream opened

    def half_close(self) -> None:
        if not self.half_closed:
            self.half_closed = True
            self.requests.put(CLOSE)

"""What the engines tell an observer (metrics) after each step, as plain host values.

The engines take an optional observer and call it once per step with a record built from
values the step already has on the host (accepted lengths come from the verify step's one
`.tolist()`; times are `time.perf_counter()` around phases). An observer therefore never
adds a host-device sync. `chainspec.metrics` implements these protocols with Prometheus
metrics; tests may pass fakes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from chainspec.engine.request import RequestOutput
from chainspec.engine.schedule import Work
from chainspec.engine.verify_batch import VerifyResult


@dataclass(frozen=True)
class VerifierStepRecord:
    """One verifier step. Times are `time.perf_counter()` seconds."""

    started_s: float
    drafts_s: float  # drafts collected: the wait for drafts ends, the verify work begins
    finished_s: float
    work: Sequence[Work]  # what the forward ran (empty: the step only reaped)
    verdicts: Sequence[VerifyResult | None]  # per work item; None: a non-final prefill chunk
    outputs: Sequence[RequestOutput]
    running: int
    waiting: int
    kv_usage: float  # KV blocks in use / blocks the cache has
    speculative: bool  # a drafter is configured: a VERIFY item without drafts is a fallback
    groups: int = 1  # pipelined groups with running sequences (this step ran one of them)
    ahead_hits: int = 0  # verdicts a look-ahead guessed exactly: next drafts at once
    ahead_misses: int = 0  # verdicts that had a look-ahead which guessed wrong


class VerifierObserver(Protocol):
    def request_added(self, request_id: str, prompt_len: int, arrival_s: float) -> None:
        """A request entered the engine (`arrival_s`: when it reached the server)."""

    def step_done(self, step: VerifierStepRecord) -> None:
        """After every `VerifierEngine.step()`, on the engine's thread."""


@dataclass(frozen=True)
class DraftRoundRecord:
    """One `DrafterEngine.update()`: the draft round it ran (if any) and its failures."""

    round_s: float  # whole update, outputs on the host
    window_rows: Sequence[int]  # rows of each drafted sequence's window (empty: no round)
    replayed: bool  # a captured CUDA graph ran the round
    eager_reason: str | None  # why not: "no_graph", "batch_too_large", "window_too_large"
    step_s: Sequence[float]  # per chained step 1..K; empty when not measured (graph replay)
    out_of_sync: int  # updates refused FAILED_PRECONDITION (the verifier resyncs them)
    prefix_queried: int = 0  # prefix positions new sequences asked to read from the cache
    prefix_hit: int = 0  # of them, read from it (their MTP KV not recomputed)
    depth: int = 0  # draft steps the round ran (drafter-side depth, 4.11); 0: no round


class DrafterObserver(Protocol):
    def update_done(self, update: DraftRoundRecord) -> None:
        """After every `DrafterEngine.update()`, on the engine's thread."""

    def occupancy(self, sequences: int, kv_usage: float) -> None:
        """After every update and release: sequences held, and the share of the KV cache's
        blocks they hold."""

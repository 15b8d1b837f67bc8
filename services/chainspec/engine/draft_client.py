"""How the verifier reaches drafters. The in-process client calls a `DrafterEngine`
directly; the gRPC client (rpc/) implements the same three verbs over a stream."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from chainspec.engine.draft_types import DraftAhead, SeqOutcome, SeqUpdate, by_sequence
from chainspec.engine.drafter import DrafterEngine


class DraftClient(Protocol):
    def submit(self, updates: Sequence[SeqUpdate]) -> None:
        """Send one batch of updates; drafts come back through `collect`."""

    def collect(self, wait_for: Collection[int] | None = None) -> dict[int, SeqOutcome]:
        """Outcomes for submitted updates that arrived in time (may be partial). Waits
        (up to the round deadline) only for drafts of `wait_for` (None: every sequence);
        outcomes of other sequences that are in are handed over too."""

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget sequences (finished, aborted, or moved elsewhere)."""

    def ahead(self) -> dict[int, tuple[DraftAhead, ...]]:
        """Look-ahead entries that arrived since the last call (never waits), per
        sequence in rank order (the most likely verdict first)."""


class LocalDraftClient:
    """In-process drafter: `submit` drafts at once, `collect` hands the results over."""

    def __init__(self, engine: DrafterEngine) -> None:
        self.engine = engine
        engine.ahead_clock = None  # NOTE: the step waits for look-aheads: none to fit in
        self._ready: dict[int, SeqOutcome] = {}
        self._ahead: dict[int, tuple[DraftAhead, ...]] = {}

    def submit(self, updates: Sequence[SeqUpdate]) -> None:
        for upd, outcome in zip(updates, self.engine.update(updates), strict=True):
            self._ready[upd.seq_id] = outcome
        e = self.engine
        self._ahead.update(by_sequence(e.look_ahead_early(e.pending_early())))
        self._ahead.update(by_sequence(e.look_ahead()))

    def ahead(self) -> dict[int, tuple[DraftAhead, ...]]:
        entries, self._ahead = self._ahead, {}
        return entries

    def collect(self, wait_for: Collection[int] | None = None) -> dict[int, SeqOutcome]:
        ready, self._ready = self._ready, {}
        return ready

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._ahead.pop(seq_id, None)
        self.engine.release(seq_ids)

"""How a linear-attention layer finds its sequences' recurrent states (DESIGN 4.9).

A step's `StateRows` says, per sequence, which state slot it owns, which kept row holds
its committed state (-1: start from zero, a prefill from position 0) and whether to keep
the state after every row (a verify window of K+1 rows) or only after the last (a
prefill chunk or plain decode; kept as row 0). After j drafts are accepted the engine
points `src` at row j: nothing is recomputed and nothing is copied. `snaps` asks for the
state after chosen rows of a prefill span as well, written to other (slot, row) places
of the pool: the snapshots of prefix caching at block boundaries (engine/state_snapshots.py).

The layer asks a `RecurrentAccess` for each sequence's rows and states; the pooled one
reads and writes the engine's pool, the zero one (dense references) starts every
sequence from zero and keeps nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class StateRows:
    spans: tuple[tuple[int, int], ...]  # packed rows [a, b) of each sequence (host)
    slots: tuple[int, ...]  # state slot per sequence (host; -1 = padding sequence)
    src: tuple[int, ...]  # kept row with the committed state, -1 = zero state (host)
    keep: tuple[bool, ...]  # keep every row's state (host)
    seq_starts: torch.Tensor  # [S + 1] int64: span starts, then the last end (kernels)
    slot_ids: torch.Tensor  # [S] int64
    src_rows: torch.Tensor  # [S] int64
    keep_flags: torch.Tensor  # [S] int64: 1 = keep every row's state (kernels)
    # per sequence: (row of its span, slot, kept row) to write the state after that row
    # to besides (host; prefill spans only: the torch path writes them, not the kernels)
    snaps: tuple[tuple[tuple[int, int, int], ...], ...] = ()

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, bool]], spans: Sequence[tuple[int, int]],
              device: torch.device | str = "cpu",
              snaps: Sequence[Sequence[tuple[int, int, int]]] = ()) -> StateRows:
        """`seqs`: (slot, src, keep) per sequence; `spans`: its packed rows [a, b)
        (padding rows of a static buffer lie outside every span); `snaps`: per sequence,
        the snapshots to write (none given: none)."""
        slots = tuple(s for s, _, _ in seqs)
        src = tuple(r for _, r, _ in seqs)

        def t(x) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)
        starts = [a for a, _ in spans] + [spans[-1][1] if spans else 0]
        keep = tuple(bool(k) for _, _, k in seqs)
        snapped = tuple(tuple(x) for x in snaps) if any(snaps) else ()
        return cls(tuple(spans), slots, src, keep, t(starts), t(slots), t(src),
                   t([int(k) for k in keep]), snapped)

    @property
    def snapshots(self) -> bool:
        """Whether some sequence asks for snapshots (the torch path writes them)."""
        return bool(self.snaps)


class RecurrentAccess(Protocol):
    """A linear-attention layer's view of this step's states."""

    @property
    def spans(self) -> Sequence[tuple[int, int]]: ...

    def load(self, seq: int) -> tuple[torch.Tensor, ...] | None:
        """Sequence `seq`'s committed state tensors (copies), or None: start from zero."""

    def keeps_every_row(self, seq: int) -> bool: ...

    def snapshot_rows(self, seq: int) -> tuple[int, ...]:
        """Rows of the span whose state is stored too (snapshots), ascending."""

    def store(self, seq: int, row: int, state: Sequence[torch.Tensor]) -> None:
        """The state after row `row` of the sequence's span (called for every row when
        `keeps_every_row`, else for the last row and the `snapshot_rows`)."""


class PooledStates:
    """Reads and writes `pool`: one tensor per state part, `[slots, rows_kept, *shape]`."""

    def __init__(self, pool: Sequence[torch.Tensor], rows: StateRows) -> None:
        self.pool, self.rows = pool, rows

    @property
    def spans(self) -> Sequence[tuple[int, int]]:
        return [span for span, slot in zip(self.rows.spans, self.rows.slots, strict=True)
                if slot >= 0] if -1 in self.rows.slots else self.rows.spans

    def _seq(self, seq: int) -> int:
        """Index among all sequences of the `seq`-th non-padding one."""
        if -1 not in self.rows.slots:
            return seq
        return [i for i, s in enumerate(self.rows.slots) if s >= 0][seq]

    def load(self, seq: int) -> tuple[torch.Tensor, ...] | None:
        i = self._seq(seq)
        src = self.rows.src[i]
        if src < 0:
            return None
        return tuple(p[self.rows.slots[i], src].clone() for p in self.pool)

    def keeps_every_row(self, seq: int) -> bool:
        return self.rows.keep[self._seq(seq)]

    def snapshot_rows(self, seq: int) -> tuple[int, ...]:
        if not self.rows.snaps:
            return ()
        return tuple(r for r, _, _ in self.rows.snaps[self._seq(seq)])

    def store(self, seq: int, row: int, state: Sequence[torch.Tensor]) -> None:
        i = self._seq(seq)
        a, b = self.rows.spans[i]
        places = [(slot, kept) for r, slot, kept in
                  (self.rows.snaps[i] if self.rows.snaps else ()) if r == row]
        if self.rows.keep[i] or row == b - a - 1:
            places.append((self.rows.slots[i], row if self.rows.keep[i] else 0))
        for slot, kept in places:
            for p, x in zip(self.pool, state, strict=True):
                p[slot, kept].copy_(x)


class ZeroStates:
    """Dense batches: `batch` sequences of `seq_len` rows, from zero, nothing kept."""

    def __init__(self, batch: int, seq_len: int) -> None:
        self._spans = [(b * seq_len, (b + 1) * seq_len) for b in range(batch)]

    @property
    def spans(self) -> Sequence[tuple[int, int]]:
        return self._spans

    def load(self, seq: int) -> tuple[torch.Tensor, ...] | None:
        return None

    def keeps_every_row(self, seq: int) -> bool:
        return False

    def snapshot_rows(self, seq: int) -> tuple[int, ...]:
        return ()

    def store(self, seq: int, row: int, state: Sequence[torch.Tensor]) -> None:
        pass

"""Static-buffer runner for steady-state draft rounds (windows of at most 2K rows).

One `StaticDraftBuffers` owns every tensor a captured round reads or writes, allocated
once for the largest bucket, block tables and row -> sequence maps included. `prepare`
fills all of it, padding rows and padding sequences included (slot -1 and row_seq -1:
they write no KV and read none). Each bucket is a prefix view of the buffers, so a graph
captured for bucket b keeps reading the same memory; attention reads each sequence's
keys only up to its rows' positions, so a replay costs what the real lengths cost, not
`max_len`. On CUDA the round is captured per bucket and per depth (the draft steps a
round runs, 1..K: DESIGN 4.11's drafter-side depth) and replayed; elsewhere the same view
runs eagerly. Both call `draft_round`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from chainspec.engine.draft_batch import (
    DraftBatch,
    Window,
    any_sampled,
    pack_index,
    table_width,
    token_stream,
)
from chainspec.engine.draft_step import DraftOutput
from chainspec.models.attention import AttnBatch


def default_buckets(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to and including max_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_seqs] + list(range(16, max_seqs, 16))
    return sorted(set(sizes + [max_seqs]))


@dataclass(frozen=True)
class GraphKey:
    batch_size: int
    depth: int = 0  # draft steps the round runs (drafter-side depth); 0: not a draft round


class StaticDraftBuffers:
    def __init__(self, max_seqs: int, num_steps: int, hidden_size: int, max_len: int,
                 block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.rows_per_seq = 2 * num_steps
        self.tok_stride = self.rows_per_seq + num_steps
        self.num_steps, self.block_size = num_steps, block_size
        self.width = table_width(max_len, block_size)
        rows = max_seqs * self.rows_per_seq

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.positions = ints(rows)
        self.slot_mapping = ints(rows)
        self.row_seq = ints(rows)
        self.block_tables = torch.zeros(max_seqs, self.width, dtype=torch.int32, device=device)
        self.row_tok = ints(rows)
        self.last_row = ints(max_seqs)
        self.last_tok = ints(max_seqs)
        self.tokens = ints(max_seqs * self.tok_stride)
        self.hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self.temperature = torch.zeros(max_seqs, device=device)
        self.seed = ints(max_seqs)

    def prepare(self, windows: Sequence[Window], batch_size: int) -> None:
        """Fill the first `batch_size` sequences' worth of every buffer."""
        idx = pack_index(windows, self.num_steps, self.block_size, self.rows_per_seq,
                         batch_size, self.width)
        rows = batch_size * self.rows_per_seq
        for name in ("positions", "slot_mapping", "row_seq", "row_tok"):
            getattr(self, name)[:rows].copy_(torch.tensor(getattr(idx, name)))
        for name in ("last_row", "last_tok"):
            getattr(self, name)[:batch_size].copy_(torch.tensor(getattr(idx, name)))
        self.block_tables[:batch_size].copy_(torch.tensor(idx.block_tables))
        self.tokens[: batch_size * self.tok_stride].copy_(
            token_stream(windows, self.tok_stride, batch_size))
        hidden = self.hidden[:rows].view(batch_size, self.rows_per_seq, -1)
        hidden.zero_()
        for s, w in enumerate(windows):
            hidden[s, : w.num_rows].copy_(w.hidden)
        temps = [w.temperature for w in windows] + [0.0] * (batch_size - len(windows))
        self.temperature[:batch_size].copy_(torch.tensor(temps))
        seeds = [w.seed for w in windows] + [0] * (batch_size - len(windows))
        self.seed[:batch_size].copy_(torch.tensor(seeds))

    def view(self, batch_size: int, sampled: bool = True) -> DraftBatch:
        """Bucket `batch_size`'s prefix of every buffer."""
        rows = batch_size * self.rows_per_seq
        attn = AttnBatch(self.positions[:rows], self.slot_mapping[:rows], self.row_seq[:rows],
                         self.block_tables[:batch_size])
        return DraftBatch(attn, self.hidden[:rows], self.tokens[: batch_size * self.tok_stride],
                          self.row_tok[:rows], self.last_row[:batch_size],
                          self.last_tok[:batch_size], self.temperature[:batch_size],
                          self.seed[:batch_size], sampled)


class GraphRunner:
    """Three verbs: capture (per bucket, CUDA only), dispatch (pick a bucket), run."""

    def __init__(self, step_fn: Callable[[DraftBatch, int], DraftOutput],
                 buffers: StaticDraftBuffers, buckets: Sequence[int], use_graphs: bool,
                 depths: Sequence[int] | None = None) -> None:
        self.step_fn = step_fn  # (batch, depth): a round of `depth` draft steps
        self.buffers = buffers
        self.buckets = sorted(buckets)
        self.depths = sorted(depths or [buffers.num_steps])
        self.use_graphs = use_graphs and torch.cuda.is_available()
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, DraftOutput]] = {}
        self.replays = 0
        self.eager_runs = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, windows: Sequence[Window]) -> bool:
        return (len(windows) <= self.max_batch
                and all(w.num_rows <= self.buffers.rows_per_seq for w in windows))

    def dispatch(self, num_seqs: int, depth: int | None = None) -> GraphKey:
        return GraphKey(next(b for b in self.buckets if b >= num_seqs),
                        self.depths[-1] if depth is None else depth)

    def capture(self) -> None:
        """Capture every bucket, largest first, in one shared memory pool (CUDA only).

        Captured with padding sequences only: every row has slot -1 and row_seq -1, so
        capture writes no KV, and the recorded kernels do not depend on the data."""
        if not self.use_graphs:
            return
        pool = None
        for size in reversed(self.buckets):
            for depth in reversed(self.depths):
                key = GraphKey(size, depth)
                self.buffers.prepare([], size)
                batch = self.buffers.view(size)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.step_fn(batch, depth)  # warm-up outside the graph
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.step_fn(batch, depth)
                pool = graph.pool()
                self.graphs[key] = (graph, out)

    def run(self, windows: Sequence[Window], depth: int | None = None) -> DraftOutput:
        """Prepare the buffers, replay (or run eagerly) a round of `depth` draft steps
        (default: all), and copy the outputs out."""
        key = self.dispatch(len(windows), depth)
        self.buffers.prepare(windows, key.batch_size)
        captured = self.graphs.get(key)
        if captured is not None:
            graph, out = captured
            graph.replay()
            self.replays += 1
        else:
            out = self.step_fn(self.buffers.view(key.batch_size, any_sampled(windows)),
                               key.depth)
            self.eager_runs += 1
        n = len(windows)
        # NOTE: copy out before the next replay overwrites the graph's output tensors.
        return DraftOutput(out.tokens[:n].clone(), out.support[:n].clone(), out.probs[:n].clone(),
                           out.chain[:n].clone())

"""Static buffers and CUDA graphs for the verifier's decode and verify steps.

A step whose work is all verify windows (plain decode rows are windows without drafts)
runs on `StaticVerifyBuffers`: sequence s owns rows [s*(K+1), (s+1)*(K+1)), padded to a
batch-size bucket. Padding rows and padding sequences carry slot -1 and row_seq -1: they
write no KV and read none; block tables and positions live in the buffers, so a replay
reads only the keys each sequence has. On CUDA the forward is captured per bucket and
replayed; elsewhere (and for tests on CPU) the same view runs eagerly. Both call
`verify_forward`. Prefill chunks always take the eager packed path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chainspec.engine.draft_batch import table_width
from chainspec.engine.graph_runner import GraphKey, default_buckets
from chainspec.engine.schedule import Work, WorkKind
from chainspec.models.attention import AttnBatch, PagedAttention
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.target import TargetModel

MAX_GRAPH_BATCH = 64  # larger batches run the packed path


def verify_forward(model: TargetModel, cache: ModelKVCache, ids: torch.Tensor,
                   batch: AttnBatch) -> torch.Tensor:
    """The one step function: ids [T] -> hidden [T, H], KV written through the tables."""
    return model(ids, batch.positions, PagedAttention(cache, batch, model.attention_scale))


class StaticVerifyBuffers:
    def __init__(self, max_seqs: int, num_steps: int, max_len: int, block_size: int,
                 device: torch.device) -> None:
        self.rows_per_seq, self.block_size = num_steps + 1, block_size
        rows = max_seqs * self.rows_per_seq

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.ids = ints(rows)
        self.positions = ints(rows)
        self.slot_mapping = ints(rows)
        self.row_seq = ints(rows)
        self.block_tables = torch.zeros(max_seqs, table_width(max_len, block_size),
                                        dtype=torch.int32, device=device)

    def prepare(self, work: Sequence[Work], batch_size: int) -> None:
        """Fill the first `batch_size` sequences' rows (host lists, one copy per buffer)."""
        q, bs = self.rows_per_seq, self.block_size
        ids, pos, slots, seqs = [0] * (batch_size * q), [0] * (batch_size * q), \
            [-1] * (batch_size * q), [-1] * (batch_size * q)
        tables = torch.zeros(batch_size, self.block_tables.shape[1], dtype=torch.int32)
        for s, w in enumerate(work):
            blocks = w.request.blocks.blocks
            tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for r, tok in enumerate(w.tokens):
                p = w.start + r
                ids[s * q + r], pos[s * q + r], seqs[s * q + r] = tok, p, s
                slots[s * q + r] = blocks[p // bs] * bs + p % bs
        n = batch_size * q
        for buf, host in ((self.ids, ids), (self.positions, pos),
                          (self.slot_mapping, slots), (self.row_seq, seqs)):
            buf[:n].copy_(torch.tensor(host))
        self.block_tables[:batch_size].copy_(tables)

    def view(self, batch_size: int) -> tuple[torch.Tensor, AttnBatch]:
        n = batch_size * self.rows_per_seq
        return self.ids[:n], AttnBatch(self.positions[:n], self.slot_mapping[:n],
                                       self.row_seq[:n], self.block_tables[:batch_size])


class VerifyGraphs:
    """Capture (per bucket, CUDA only), dispatch (pick a bucket), run (replay or eager)."""

    def __init__(self, model: TargetModel, cache: ModelKVCache, max_seqs: int,
                 num_steps: int, max_len: int, use_graphs: bool,
                 static_on_cpu: bool = False) -> None:
        self.model, self.cache = model, cache
        device = next(model.parameters()).device
        max_seqs = min(max_seqs, MAX_GRAPH_BATCH)
        self.buffers = StaticVerifyBuffers(max_seqs, num_steps, max_len, cache.block_size,
                                           device)
        self.buckets = default_buckets(max_seqs)
        self.use_graphs = use_graphs and device.type == "cuda"
        # NOTE: without graphs the packed path is cheaper (no padding rows), so the static
        # path runs only where it is captured, or when a test asks for it.
        self.enabled = self.use_graphs or static_on_cpu
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = self.eager_runs = 0

    @property
    def rows_per_seq(self) -> int:
        return self.buffers.rows_per_seq

    def fits(self, work: Sequence[Work]) -> bool:
        # NOTE: windowed groups and recurrent states run the packed path (not captured)
        plain = not self.cache.windows and not self.cache.has_states
        return (self.enabled and plain and 0 < len(work) <= self.buckets[-1]
                and all(w.kind is WorkKind.VERIFY for w in work))

    def dispatch(self, num_seqs: int) -> GraphKey:
        return GraphKey(next(b for b in self.buckets if b >= num_seqs))

    def capture(self) -> None:
        """Every bucket, largest first, one shared memory pool; padding only (no KV writes)."""
        if not self.use_graphs:
            return
        pool = None
        for size in reversed(self.buckets):
            self.buffers.prepare([], size)
            ids, batch = self.buffers.view(size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                verify_forward(self.model, self.cache, ids, batch)  # warm-up
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = verify_forward(self.model, self.cache, ids, batch)
            pool = graph.pool()
            self.graphs[GraphKey(size)] = (graph, hidden)

    def run(self, work: Sequence[Work]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Hidden states [bucket * (K+1), H] and each item's first row.

        NOTE: a replay's output lives in the graph's memory until the next replay; the
        verifier reads it (acceptance, drafter updates) within the same step."""
        key = self.dispatch(len(work))
        self.buffers.prepare(work, key.batch_size)
        captured = self.graphs.get(key)
        if captured is not None:
            graph, hidden = captured
            graph.replay()
            self.replays += 1
        else:
            hidden = verify_forward(self.model, self.cache, *self.buffers.view(key.batch_size))
            self.eager_runs += 1
        return hidden, tuple(i * self.rows_per_seq for i in range(len(work)))

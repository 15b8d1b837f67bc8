"""Static buffers and CUDA graphs for the verifier's decode and verify steps.

A step whose work is all verify windows (plain decode rows are windows without drafts)
runs on `StaticVerifyBuffers`: the rows packed back to back as on the packed path, then
padding up to a batch-size bucket of K+1 rows per sequence. Padding rows and padding
sequences carry slot -1 and row_seq -1: they write no KV and read none; block tables
(one per cache group: full length, each window size) and positions live in the buffers,
so a replay reads only the keys each sequence has. Recurrent states (DESIGN 4.9) come as
`StateRows` over the same buffers: the spans are the packed path's, padding sequences
have state slot -1 and an empty span, padding rows lie outside every span.

On CUDA the forward is captured per bucket and replayed when the model is `graph_safe`
(no layer reads host-side step data: the GDN torch reference loops over host spans, a
captured graph would freeze them); elsewhere (and for tests on CPU) the same view runs
eagerly. Both call `verify_forward`. Prefill chunks always take the eager packed path.

A TP leader (`engine/tp_group.TPLeader`) brings `graph_peers`: this rank captures its
shard (the all-reduces inside are the graph's only collectives; graph safe on NCCL only),
every other rank allocates the same buffers and captures the same buckets in the same
order, and each step the leader sends the bucket's filled view to them (host work,
outside the graph) before all replay together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chainspec.engine.draft_batch import table_width
from chainspec.engine.graph_runner import GraphKey, default_buckets
from chainspec.engine.schedule import Work, WorkKind
from chainspec.models.attention import AttnBatch, PagedAttention, PagedGroup, SeqRows
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.recurrent import StateRows
from chainspec.models.target import TargetModel

MAX_GRAPH_BATCH = 64  # larger batches run the packed path


def verify_forward(model: TargetModel, cache: ModelKVCache, ids: torch.Tensor,
                   batch: AttnBatch) -> torch.Tensor:
    """The one step function: ids [T] -> hidden [T, H], KV written through the tables."""
    return model(ids, batch.positions, PagedAttention(cache, batch, model.attention_scale))


def seq_rows(w: Work) -> SeqRows:
    """A work item's rows and its sequence's cache claims. A verify window keeps the
    state after every row; a prefill chunk or plain decode row only after its last."""
    claims = w.request.claims
    return SeqRows(w.request.blocks.blocks, w.start, w.num_rows, claims.tables(),
                   claims.state_slot, claims.state_row if w.start else -1,
                   w.kind is WorkKind.VERIFY, claims.snapshots_due)


class StaticVerifyBuffers:
    """Everything a captured verify step reads, allocated once for `max_seqs` sequences
    of K+1 rows: ids, positions, row_seq [rows]; per cache group (None: full length, else
    a window size) a slot mapping [rows] and block tables [max_seqs, width]; with
    `with_states`, `StateRows`' tensors."""

    def __init__(self, max_seqs: int, num_steps: int, max_len: int, block_size: int,
                 device: torch.device, windows: Sequence[int] = (),
                 with_states: bool = False) -> None:
        self.rows_per_seq, self.block_size = num_steps + 1, block_size
        rows, width = max_seqs * self.rows_per_seq, table_width(max_len, block_size)

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        def group() -> PagedGroup:
            return PagedGroup(ints(rows), torch.zeros(max_seqs, width, dtype=torch.int32,
                                                      device=device))
        self.ids = ints(rows)  # [rows]
        self.positions = ints(rows)  # [rows]
        self.row_seq = ints(rows)  # [rows]
        self.groups = {key: group() for key in (None, *windows)}
        self.states: tuple[torch.Tensor, ...] | None = None
        if with_states:  # span starts [max_seqs + 1]; slot, src row, keep [max_seqs]
            self.states = (ints(max_seqs + 1), ints(max_seqs), ints(max_seqs),
                           ints(max_seqs))
        self._state_host: tuple[tuple, ...] = ((), (), (), ())

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.groups[None].slot_mapping

    @property
    def block_tables(self) -> torch.Tensor:
        return self.groups[None].block_tables

    def prepare(self, work: Sequence[Work], batch_size: int) -> tuple[int, ...]:
        """Fill the first `batch_size` sequences' rows (host lists, one copy per buffer);
        returns each item's first row."""
        n = batch_size * self.rows_per_seq
        seqs = [seq_rows(w) for w in work]
        offsets = tuple(sum(r.num_rows for r in seqs[:i]) for i in range(len(seqs)))
        pad = n - sum(r.num_rows for r in seqs)
        ids = [t for w in work for t in w.tokens] + [0] * pad
        pos = [p for r in seqs for p in range(r.start, r.start + r.num_rows)] + [0] * pad
        row_seq = [s for s, r in enumerate(seqs) for _ in range(r.num_rows)] + [-1] * pad
        for buf, host in ((self.ids, ids), (self.positions, pos), (self.row_seq, row_seq)):
            buf[:n].copy_(torch.tensor(host))
        for key, g in self.groups.items():
            tables = [r.block_table if key is None else r.window_tables[key] for r in seqs]
            self._fill_group(g, tables, seqs, batch_size, pad)
        if self.states is not None:
            self._fill_states(seqs, offsets, batch_size, n - pad)
        return offsets

    def _fill_group(self, g: PagedGroup, tables: Sequence[Sequence[int]],
                    seqs: Sequence[SeqRows], batch_size: int, pad: int) -> None:
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for table, r in zip(tables, seqs, strict=True)
                 for p in range(r.start, r.start + r.num_rows)] + [-1] * pad
        host = torch.zeros(batch_size, g.block_tables.shape[1], dtype=torch.int32)
        for s, table in enumerate(tables):
            host[s, :len(table)] = torch.tensor(table, dtype=torch.int32)
        g.slot_mapping[:len(slots)].copy_(torch.tensor(slots))
        g.block_tables[:batch_size].copy_(host)

    def _fill_states(self, seqs: Sequence[SeqRows], offsets: Sequence[int], batch_size: int,
                     end: int) -> None:
        """The packed path's spans, slots, committed rows and keep flags, then padding
        sequences (slot -1, empty spans at `end`); and the host tuples the torch
        reference loops over."""
        pad = batch_size - len(seqs)
        spans = [(a, a + r.num_rows) for a, r in zip(offsets, seqs, strict=True)]
        spans += [(end, end)] * pad
        slots = [r.state_slot for r in seqs] + [-1] * pad
        src = [r.state_src for r in seqs] + [-1] * pad
        keep = [r.keep_rows for r in seqs] + [False] * pad
        starts = [a for a, _ in spans] + [end]
        for buf, host in zip(self.states, (starts, slots, src, [int(k) for k in keep]),
                             strict=True):
            buf[:len(host)].copy_(torch.tensor(host))
        self._state_host = (tuple(spans), tuple(slots), tuple(src), tuple(keep))

    def fill(self, ids: torch.Tensor, batch: AttnBatch, batch_size: int) -> None:
        """Copy another rank's `view(batch_size)` (a TP leader's step) into these buffers."""
        own_ids, own = self.view(batch_size)
        own_ids.copy_(ids)
        own.positions.copy_(batch.positions)
        own.row_seq.copy_(batch.row_seq)
        for key, g in self.groups.items():
            src = batch.group(key)
            g.slot_mapping[:src.slot_mapping.shape[0]].copy_(src.slot_mapping)
            g.block_tables[:batch_size].copy_(src.block_tables)
        if self.states is not None:
            s = batch.states
            for buf, src in zip(self.states, (s.seq_starts, s.slot_ids, s.src_rows,
                                               s.keep_flags), strict=True):
                buf[:src.shape[0]].copy_(src)
            self._state_host = (s.spans, s.slots, s.src, s.keep)

    def view(self, batch_size: int) -> tuple[torch.Tensor, AttnBatch]:
        """This bucket's ids and batch (call `prepare` with the same size first)."""
        n = batch_size * self.rows_per_seq
        groups = {key: PagedGroup(g.slot_mapping[:n], g.block_tables[:batch_size])
                  for key, g in self.groups.items()}
        main = groups.pop(None)
        states = None
        if self.states is not None:
            starts, slots, src, keep = self.states
            states = StateRows(*self._state_host, starts[:batch_size + 1],
                               slots[:batch_size], src[:batch_size], keep[:batch_size])
        return self.ids[:n], AttnBatch(self.positions[:n], main.slot_mapping,
                                       self.row_seq[:n], main.block_tables, groups, states)


class VerifyGraphs:
    """Capture (per bucket, CUDA only), dispatch (pick a bucket), run (replay or eager)."""

    def __init__(self, model: TargetModel, cache: ModelKVCache, max_seqs: int,
                 num_steps: int, max_len: int, use_graphs: bool,
                 static_on_cpu: bool = False) -> None:
        self.model, self.cache = model, cache
        # a TP leader's other ranks: they fill their buffers and replay alongside
        self.peers = getattr(model, "graph_peers", None)
        self.compute = model if self.peers is None else self.peers.model  # run or captured
        self.num_steps, self.max_len = num_steps, max_len
        device = next(model.parameters()).device
        max_seqs = min(max_seqs, MAX_GRAPH_BATCH)
        self.max_seqs = max_seqs
        self.buffers = StaticVerifyBuffers(max_seqs, num_steps, max_len, cache.block_size,
                                           device, cache.windows, cache.has_states)
        self.buckets = default_buckets(max_seqs)
        # NOTE: a model with a layer that reads host-side step data is never captured
        self.use_graphs = use_graphs and device.type == "cuda" and model.graph_safe
        # NOTE: without graphs the packed path is cheaper (no padding rows), so the static
        # path runs only where it is captured, or when a test asks for it.
        self.enabled = self.use_graphs or static_on_cpu
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = self.eager_runs = 0

    @property
    def rows_per_seq(self) -> int:
        return self.buffers.rows_per_seq

    def fits(self, work: Sequence[Work]) -> bool:
        return (self.enabled and 0 < len(work) <= self.buckets[-1]
                and all(w.kind is WorkKind.VERIFY for w in work))

    def dispatch(self, num_seqs: int) -> GraphKey:
        return GraphKey(next(b for b in self.buckets if b >= num_seqs))

    def capture(self) -> None:
        """Every bucket, largest first, one shared memory pool; padding only (no KV writes).
        A TP leader's peers set up the same buffers (and capture alongside) first."""
        if self.enabled and self.peers is not None:
            self.peers.setup(self.cache, self.max_seqs, self.num_steps, self.max_len,
                             self.use_graphs)
        if not self.use_graphs:
            return
        pool = None
        for size in reversed(self.buckets):
            self.buffers.prepare([], size)
            ids, batch = self.buffers.view(size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                verify_forward(self.compute, self.cache, ids, batch)  # warm-up
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = verify_forward(self.compute, self.cache, ids, batch)
            pool = graph.pool()
            self.graphs[GraphKey(size)] = (graph, hidden)

    def run(self, work: Sequence[Work]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Hidden states [bucket * (K+1), H] and each item's first row.

        NOTE: a replay's output lives in the graph's memory until the next replay; the
        verifier reads it (acceptance, drafter updates) within the same step."""
        key = self.dispatch(len(work))
        offsets = self.buffers.prepare(work, key.batch_size)
        return self.launch(key), offsets

    def launch(self, key: GraphKey) -> torch.Tensor:
        """Replay `key`'s graph, or run its view eagerly, over the filled buffers; a TP
        leader first sends the view to its peers (outside the graph)."""
        ids, batch = self.buffers.view(key.batch_size)
        if self.peers is not None:
            self.peers.replay(key.batch_size, ids, batch)
        captured = self.graphs.get(key)
        if captured is not None:
            graph, hidden = captured
            graph.replay()
            self.replays += 1
        else:
            hidden = verify_forward(self.compute, self.cache, ids, batch)
            self.eager_runs += 1
        return hidden

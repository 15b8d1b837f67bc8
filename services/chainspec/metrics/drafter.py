"""The drafter's metrics: round and per-step times, the draft steps each round ran,
window and batch shapes, graph replays vs eager runs, sequences held, KV usage and
out-of-sync refusals.

`DrafterMetrics` is the `DrafterEngine`'s observer (`engine/observer.py`); it records into
a `Recorder` (one lock per update).
"""

from __future__ import annotations

from chainspec.engine.observer import DraftRoundRecord
from chainspec.metrics.buckets import COUNTS, STEP_S
from chainspec.metrics.recorder import Recorder
from chainspec.metrics.service import GrpcServiceMetrics

EAGER_REASONS = ("no_graph", "batch_too_large", "window_too_large")


class DrafterMetrics(GrpcServiceMetrics):
    def __init__(self, model: str, num_steps: int) -> None:
        super().__init__(model)
        rec = self.recorder = Recorder({"model_name": model})
        steps = rec.histogram("chainspec_drafter_step_seconds", "One chained draft step "
                              "(module k, head, sampling), by step 1..K; not measured on "
                              "graph replays", STEP_S, "step")
        self.step_s = [steps.child(str(k)) for k in range(1, num_steps + 1)]
        self.round_s = rec.histogram("chainspec_drafter_round_seconds", "One draft round (an "
                                     "update batch), drafts on the host", STEP_S).child()
        self.window_rows = rec.histogram("chainspec_drafter_window_rows", "Rows of one "
                                         "sequence's window in a round (history + new rows)",
                                         COUNTS).child()
        self.batch_size = rec.histogram("chainspec_drafter_batch_size",
                                        "Sequences drafted in one round", COUNTS).child()
        depth = rec.counter("chainspec_drafter_round_depth", "Draft rounds by the draft "
                            "steps they ran (the deepest depth their updates asked for)",
                            "depth")
        self.depth = {d: depth.child(str(d)) for d in range(1, num_steps + 1)}
        self.replays = rec.counter("chainspec_drafter_graph_replays",
                                   "Rounds run by replaying a CUDA graph").child()
        eager = rec.counter("chainspec_drafter_eager_runs", "Rounds run eagerly, by why no "
                            "graph replayed", "reason")
        self.eager = {reason: eager.child(reason) for reason in EAGER_REASONS}
        self.out_of_sync = rec.counter("chainspec_drafter_out_of_sync", "Updates refused "
                                       "FAILED_PRECONDITION (unknown sequence or wrong "
                                       "start)").child()
        self.prefix_queries = rec.counter(
            "chainspec_drafter_prefix_cache_queries", "Prefix positions of new sequences "
            "the verifier read from its prefix cache, looked up in the drafter's").child()
        self.prefix_hits = rec.counter(
            "chainspec_drafter_prefix_cache_hits", "Of those, positions whose MTP KV the "
            "drafter read from its cache (a miss is resynced)").child()
        self.sequences = rec.gauge("chainspec_drafter_sequences", "Sequences held").child()
        self.kv_usage = rec.gauge("chainspec_drafter_kv_cache_usage_perc",
                                  "Drafter KV cache blocks in use / blocks (a fraction)").child()
        self.registry.register(rec)

    # -- DrafterObserver (engine thread) --------------------------------------------------
    def update_done(self, update: DraftRoundRecord) -> None:
        with self.recorder.lock:
            self.out_of_sync.value += update.out_of_sync
            self.prefix_queries.value += update.prefix_queried
            self.prefix_hits.value += update.prefix_hit
            if not update.window_rows:
                return  # every update failed: no round ran
            self.round_s.observe(update.round_s)
            if update.depth in self.depth:
                self.depth[update.depth].value += 1
            self.batch_size.observe(len(update.window_rows))
            for rows in update.window_rows:
                self.window_rows.observe(rows)
            if update.replayed:
                self.replays.value += 1
            else:
                self.eager[update.eager_reason].value += 1
            for child, seconds in zip(self.step_s, update.step_s, strict=False):
                child.observe(seconds)

    def occupancy(self, sequences: int, kv_usage: float) -> None:
        with self.recorder.lock:
            self.sequences.value = sequences
            self.kv_usage.value = kv_usage

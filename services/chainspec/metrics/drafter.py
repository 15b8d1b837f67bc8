"""The drafter's metrics: round and per-step times, window and batch shapes, graph
replays vs eager runs, sequences held, KV usage and out-of-sync refusals.

`DrafterMetrics` is the `DrafterEngine`'s observer (`engine/observer.py`).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from chainspec.engine.observer import DraftRoundRecord
from chainspec.metrics.buckets import COUNTS, STEP_S
from chainspec.metrics.service import GrpcServiceMetrics

EAGER_REASONS = ("no_graph", "batch_too_large", "window_too_large")


class DrafterMetrics(GrpcServiceMetrics):
    def __init__(self, model: str, num_steps: int) -> None:
        super().__init__(model)
        r = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=r).labels(model)

        steps = Histogram("chainspec_drafter_step_seconds", "One chained draft step (module "
                          "k, head, sampling), by step 1..K; not measured on graph replays",
                          ["model", "step"], buckets=STEP_S, registry=r)
        self.step_s = [steps.labels(model, str(k)) for k in range(1, num_steps + 1)]
        self.round_s = histogram("chainspec_drafter_round_seconds", "One draft round (an "
                                 "update batch), drafts on the host", STEP_S)
        self.window_rows = histogram("chainspec_drafter_window_rows", "Rows of one sequence's "
                                     "window in a round (history + new rows)", COUNTS)
        self.batch_size = histogram("chainspec_drafter_batch_size",
                                    "Sequences drafted in one round", COUNTS)
        self.replays = Counter("chainspec_drafter_graph_replays", "Rounds run by replaying a "
                               "CUDA graph", ["model"], registry=r).labels(model)
        eager = Counter("chainspec_drafter_eager_runs", "Rounds run eagerly, by why no graph "
                        "replayed", ["model", "reason"], registry=r)
        self.eager = {reason: eager.labels(model, reason) for reason in EAGER_REASONS}
        self.out_of_sync = Counter("chainspec_drafter_out_of_sync", "Updates refused "
                                   "FAILED_PRECONDITION (unknown sequence or wrong start)",
                                   ["model"], registry=r).labels(model)
        self.sequences = Gauge("chainspec_drafter_sequences", "Sequences held", ["model"],
                               registry=r).labels(model)
        self.kv_usage = Gauge("chainspec_drafter_kv_cache_usage_ratio", "Drafter KV rows "
                              "held / KV rows (0-1)", ["model"], registry=r).labels(model)

    # -- DrafterObserver (engine thread) --------------------------------------------------
    def update_done(self, update: DraftRoundRecord) -> None:
        if update.out_of_sync:
            self.out_of_sync.inc(update.out_of_sync)
        if not update.window_rows:
            return  # every update failed: no round ran
        self.round_s.observe(update.round_s)
        self.batch_size.observe(len(update.window_rows))
        for rows in update.window_rows:
            self.window_rows.observe(rows)
        if update.replayed:
            self.replays.inc()
        else:
            self.eager[update.eager_reason].inc()
        for child, seconds in zip(self.step_s, update.step_s, strict=False):
            child.observe(seconds)

    def occupancy(self, sequences: int, kv_usage: float) -> None:
        self.sequences.set(sequences)
        self.kv_usage.set(kv_usage)

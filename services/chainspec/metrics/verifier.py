"""The verifier's metrics: spec-decode counters in vLLM's shape, tokens, request latencies,
queue and KV gauges, verify and draft times, and the draft pool's counters.

`VerifierMetrics` is the engine's observer (`engine/observer.py`) and the draft pool's
(round trips). Everything it records comes from host values the step already has.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from chainspec.engine.observer import VerifierStepRecord
from chainspec.engine.request import FinishReason, RequestOutput
from chainspec.engine.schedule import WorkKind
from chainspec.metrics.buckets import E2E_LATENCY_S, REQUEST_LATENCY_S, STEP_S
from chainspec.metrics.service import GrpcServiceMetrics

FALLBACK_REASONS = ("late", "stale", "resync", "no_drafter")
DONE = (FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS)  # completed, not cut off


@dataclass
class _Times:
    arrival_s: float
    scheduled: bool = False
    last_token_s: float | None = None


class VerifierMetrics(GrpcServiceMetrics):
    def __init__(self, model: str, num_steps: int) -> None:
        super().__init__(model)
        self.num_steps = num_steps
        r = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ["model", *labels], registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, ["model"], buckets=buckets, registry=r).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model"], registry=r).labels(model)

        self.drafts = counter("chainspec_spec_decode_num_drafts",
                              "Verify rounds that carried drafts").labels(model)
        self.draft_tokens = counter("chainspec_spec_decode_num_draft_tokens",
                                    "Draft tokens verified").labels(model)
        self.accepted = counter("chainspec_spec_decode_num_accepted_tokens",
                                "Draft tokens accepted").labels(model)
        per_pos = counter("chainspec_spec_decode_num_accepted_tokens_per_pos",
                          "Draft tokens accepted at each draft position (0-based)", "position")
        self.accepted_per_pos = [per_pos.labels(model, str(i)) for i in range(num_steps)]
        self.prompt_tokens = counter("chainspec_prompt_tokens",
                                     "Prompt tokens prefilled").labels(model)
        self.generation_tokens = counter("chainspec_generation_tokens",
                                         "Tokens generated (streamed to clients)").labels(model)
        finished = counter("chainspec_requests_finished", "Requests finished, by reason",
                           "reason")
        self.finished = {reason: finished.labels(model, str(reason)) for reason in FinishReason}
        fallbacks = counter("chainspec_plain_decode_fallbacks", "Decode rounds without drafts "
                            "while a drafter is configured, by why the drafts were missing",
                            "reason")
        self.fallbacks = {reason: fallbacks.labels(model, reason) for reason in FALLBACK_REASONS}
        self.ttft = histogram("chainspec_time_to_first_token_seconds",
                              "Arrival to first token", REQUEST_LATENCY_S)
        self.itl = histogram("chainspec_inter_token_latency_seconds", "Time per token after "
                             "the first (a round's interval shared by its tokens)", STEP_S)
        self.e2e = histogram("chainspec_e2e_request_latency_seconds",
                             "Arrival to last token of completed requests", E2E_LATENCY_S)
        self.queue_time = histogram("chainspec_request_queue_time_seconds",
                                    "Arrival to first scheduled", REQUEST_LATENCY_S)
        self.verify_step = histogram("chainspec_verify_step_seconds", "Verifier step (forward, "
                                     "acceptance, commit, updates), without the draft wait",
                                     STEP_S)
        self.draft_wait = histogram("chainspec_draft_wait_seconds",
                                    "Time a verifier step waited for drafts", STEP_S)
        self.draft_rtt = histogram("chainspec_draft_round_trip_seconds", "Draft batch sent "
                                   "to its answer received, as the verifier sees it", STEP_S)
        self.running = gauge("chainspec_num_requests_running", "Requests in sequence slots")
        self.waiting = gauge("chainspec_num_requests_waiting", "Requests queued for a slot")
        self.kv_usage = gauge("chainspec_kv_cache_usage_ratio",
                              "KV rows held by running requests / KV rows (0-1)")
        self.sources = DraftStatsCollector(model)
        r.register(self.sources)
        self.set_info(num_steps)
        self._requests: dict[str, _Times] = {}

    def attach(self, engine, pool) -> None:
        """Export the counters the engine (resyncs) and the draft pool keep themselves."""
        self.sources.engine, self.sources.pool = engine, pool

    # -- VerifierObserver (engine thread) -------------------------------------------------
    def request_added(self, request_id: str, prompt_len: int, arrival_s: float) -> None:
        self._requests[request_id] = _Times(arrival_s)

    def step_done(self, step: VerifierStepRecord) -> None:
        if step.work:
            self.verify_step.observe(step.finished_s - step.drafts_s)
            if step.speculative:
                self.draft_wait.observe(step.drafts_s - step.started_s)
            self._count_work(step)
        self._count_outputs(step.outputs, step.finished_s)
        self.running.set(step.running)
        self.waiting.set(step.waiting)
        self.kv_usage.set(step.kv_usage)

    # -- draft pool observer (engine thread or a stream's reader thread) ---------------
    def round_trip(self, seconds: float) -> None:
        self.draft_rtt.observe(seconds)

    # -- internals ------------------------------------------------------------------------
    def _count_work(self, step: VerifierStepRecord) -> None:
        drafts = draft_tokens = accepted = prompt = 0
        per_pos = [0] * self.num_steps
        for item, verdict in zip(step.work, step.verdicts, strict=True):
            req = item.request
            times = self._requests.get(req.request_id)
            if times is not None and not times.scheduled:
                times.scheduled = True
                self.queue_time.observe(step.drafts_s - times.arrival_s)
            if item.kind is WorkKind.PREFILL:
                prompt += item.num_rows
            elif item.num_drafts:
                drafts += 1
                draft_tokens += item.num_drafts
                accepted += verdict.accepted
                for i in range(verdict.accepted):
                    per_pos[i] += 1
            elif step.speculative:
                self.fallbacks[req.draft_miss or "late"].inc()
        if prompt:
            self.prompt_tokens.inc(prompt)
        if drafts:
            self.drafts.inc(drafts)
            self.draft_tokens.inc(draft_tokens)
            self.accepted.inc(accepted)
            for child, n in zip(self.accepted_per_pos, per_pos, strict=True):
                if n:
                    child.inc(n)

    def _count_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        generated = 0
        for out in outputs:
            n = len(out.new_tokens)
            generated += n
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            if n:
                if times.last_token_s is None:
                    self.ttft.observe(now - times.arrival_s)
                else:
                    per_token = (now - times.last_token_s) / n
                    for _ in range(n):
                        self.itl.observe(per_token)
                times.last_token_s = now
            if out.finished:
                self.finished[out.finish_reason].inc()
                if out.finish_reason in DONE and out.error is None:
                    self.e2e.observe(now - times.arrival_s)
                del self._requests[out.request_id]
        if generated:
            self.generation_tokens.inc(generated)


class DraftStatsCollector(Collector):
    """Counters the draft pool (`DraftPoolStats`) and the engine (resyncs) keep as plain
    ints, read at scrape time (zeros until `VerifierMetrics.attach`)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.engine = None
        self.pool = None

    def collect(self):
        stats, m = getattr(self.pool, "stats", None), [self.model]

        def counter(name: str, doc: str, value) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric(m, value)
            return family
        wire = CounterMetricFamily("chainspec_draft_transfer_bytes", "Draft stream payload "
                                   "bytes (protobuf), by direction", labels=["model",
                                                                             "direction"])
        wire.add_metric([self.model, "sent"], getattr(stats, "bytes_sent", 0))
        wire.add_metric([self.model, "received"], getattr(stats, "bytes_received", 0))
        yield wire
        yield counter("chainspec_draft_resyncs", "Drafter states rebuilt from the committed "
                      "prefix", getattr(self.engine, "resyncs", 0))
        yield counter("chainspec_draft_reassignments", "Sequences given to another drafter "
                      "after losing theirs", getattr(stats, "reassignments", 0))
        yield counter("chainspec_draft_late_batches", "Draft answers that came after their "
                      "round deadline", getattr(stats, "late_batches", 0))
        yield counter("chainspec_draft_stream_failures", "Drafter streams that broke",
                      getattr(stats, "stream_failures", 0))
        connected = GaugeMetricFamily("chainspec_drafters_connected",
                                      "Drafters this verifier can use", labels=["model"])
        connected.add_metric(m, len(self.pool.loads()) if self.pool is not None else 0)
        yield connected

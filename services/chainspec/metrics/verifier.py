"""The verifier's metrics: spec-decode counters in vLLM's shape, tokens, request latencies,
queue and KV gauges, verify and draft times, and the draft pool's counters.

`VerifierMetrics` is the engine's observer (`engine/observer.py`) and the draft pool's
(round trips). Everything it records comes from host values the step already has, into a
`Recorder` (one lock per step).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from chainspec.engine.observer import VerifierStepRecord
from chainspec.engine.request import FinishReason, RequestOutput
from chainspec.engine.schedule import WorkKind
from chainspec.metrics.buckets import E2E_LATENCY_S, REQUEST_LATENCY_S, STEP_S, TOKENS
from chainspec.metrics.recorder import Recorder
from chainspec.metrics.service import GrpcServiceMetrics

FALLBACK_REASONS = ("late", "stale", "resync", "no_drafter", "depth")  # depth: chosen k = 0
DONE = (FinishReason.LENGTH, FinishReason.STOP, FinishReason.EOS)  # completed, not cut off
# vLLM's finished_reason values (its dashboards and tools filter on them)
FINISHED_REASON = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop",
                   FinishReason.EOS: "stop", FinishReason.ABORT: "abort",
                   FinishReason.ERROR: "error"}


@dataclass
class _Times:
    """One request's lifecycle, for the per-request histograms (vLLM's phases: queued
    until scheduled, prefill until the first token, decode until the last)."""

    arrival_s: float
    prompt_len: int = 0
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    generated: int = 0

    @property
    def scheduled(self) -> bool:
        return self.scheduled_s is not None


class VerifierMetrics(GrpcServiceMetrics):
    def __init__(self, model: str, num_steps: int) -> None:
        super().__init__(model)
        self.num_steps = num_steps
        rec = self.recorder = Recorder({"model_name": model})
        self.drafts = rec.counter("chainspec_spec_decode_num_drafts",
                                  "Verify rounds that carried drafts").child()
        self.draft_tokens = rec.counter("chainspec_spec_decode_num_draft_tokens",
                                        "Draft tokens verified").child()
        self.accepted = rec.counter("chainspec_spec_decode_num_accepted_tokens",
                                    "Draft tokens accepted").child()
        per_pos = rec.counter("chainspec_spec_decode_num_accepted_tokens_per_pos",
                              "Draft tokens accepted at each draft position (0-based)",
                              "position")
        self.accepted_per_pos = [per_pos.child(str(i)) for i in range(num_steps)]
        depth = rec.counter("chainspec_spec_decode_depth", "Verify rounds by the number of "
                            "drafts verified (the chosen depth; 0: a plain decode row)",
                            "depth")
        self.depth = [depth.child(str(k)) for k in range(num_steps + 1)]
        self.prompt_tokens = rec.counter("chainspec_prompt_tokens",
                                         "Prompt tokens prefilled").child()
        self.generation_tokens = rec.counter("chainspec_generation_tokens",
                                             "Tokens generated (streamed to clients)").child()
        success = rec.counter("chainspec_request_success", "Requests finished, by vLLM's "
                              "finished_reason (stop: EOS, a stop token or string)",
                              "finished_reason")
        self.finished = {reason: success.child(FINISHED_REASON[reason])
                         for reason in FinishReason}
        fallbacks = rec.counter("chainspec_plain_decode_fallbacks", "Decode rounds without "
                                "drafts while a drafter is configured, by why the drafts "
                                "were missing", "reason")
        self.fallbacks = {reason: fallbacks.child(reason) for reason in FALLBACK_REASONS}
        self.ttft = rec.histogram("chainspec_time_to_first_token_seconds",
                                  "Arrival to first token", REQUEST_LATENCY_S).child()
        self.itl = rec.histogram("chainspec_inter_token_latency_seconds", "Time per token "
                                 "after the first (a round's interval shared by its tokens)",
                                 STEP_S).child()
        self.e2e = rec.histogram("chainspec_e2e_request_latency_seconds", "Arrival to last "
                                 "token of completed requests", E2E_LATENCY_S).child()
        self.queue_time = rec.histogram("chainspec_request_queue_time_seconds",
                                        "Arrival to first scheduled", REQUEST_LATENCY_S).child()
        self.request_prompt = rec.histogram("chainspec_request_prompt_tokens", "Prompt "
                                            "tokens of finished requests", TOKENS).child()
        self.request_generation = rec.histogram("chainspec_request_generation_tokens",
                                                "Tokens generated by finished requests",
                                                TOKENS).child()
        self.prefill_time = rec.histogram("chainspec_request_prefill_time_seconds", "First "
                                          "scheduled to first token", REQUEST_LATENCY_S).child()
        self.decode_time = rec.histogram("chainspec_request_decode_time_seconds", "First "
                                         "token to last token", E2E_LATENCY_S).child()
        self.inference_time = rec.histogram("chainspec_request_inference_time_seconds",
                                            "First scheduled to last token",
                                            E2E_LATENCY_S).child()
        self.tpot = rec.histogram("chainspec_request_time_per_output_token_seconds", "Decode "
                                  "time / (generated tokens - 1), per request", STEP_S).child()
        self.verify_step = rec.histogram("chainspec_verify_step_seconds", "Verifier step "
                                         "(forward, acceptance, commit, updates), without "
                                         "the draft wait", STEP_S).child()
        self.draft_wait = rec.histogram("chainspec_draft_wait_seconds",
                                        "Time a verifier step waited for drafts",
                                        STEP_S).child()
        self.draft_rtt = rec.histogram("chainspec_draft_round_trip_seconds", "Draft batch "
                                       "sent to its answer received, as the verifier sees it",
                                       STEP_S).child()
        self.running = rec.gauge("chainspec_num_requests_running",
                                 "Requests in sequence slots").child()
        self.waiting = rec.gauge("chainspec_num_requests_waiting",
                                 "Requests queued for a slot").child()
        self.kv_usage = rec.gauge("chainspec_kv_cache_usage_perc", "KV cache blocks in use / "
                                  "KV cache blocks (a fraction, 0-1, as vLLM's)").child()
        self.groups = rec.gauge("chainspec_pipeline_groups", "Pipelined groups taking turns "
                                "(with running sequences) at the last step; 1: not "
                                "pipelined").child()
        ahead = rec.counter("chainspec_draft_ahead_verdicts", "Verdicts a look-ahead had "
                            "guessed (DESIGN 4.8): hit (its drafts verified next, no wait) or "
                            "miss", "result")
        self.ahead = {result: ahead.child(result) for result in ("hit", "miss")}
        self.ahead_draft_tokens = rec.counter(
            "chainspec_draft_ahead_draft_tokens", "Look-ahead draft tokens verified").child()
        ahead_pos = rec.counter("chainspec_draft_ahead_accepted_tokens_per_pos",
                                "Look-ahead draft tokens accepted at each draft position "
                                "(0-based)", "position")
        self.ahead_per_pos = [ahead_pos.child(str(i)) for i in range(num_steps)]
        self.registry.register(rec)
        self.sources = DraftStatsCollector(model)
        self.registry.register(self.sources)
        self.set_info(num_steps)
        self._requests: dict[str, _Times] = {}

    def attach(self, engine, pool) -> None:
        """Export the counters the engine (resyncs) and the draft pool keep themselves."""
        self.sources.engine, self.sources.pool = engine, pool

    # -- VerifierObserver (engine thread) -------------------------------------------------
    def request_added(self, request_id: str, prompt_len: int, arrival_s: float) -> None:
        self._requests[request_id] = _Times(arrival_s, prompt_len)

    def step_done(self, step: VerifierStepRecord) -> None:
        with self.recorder.lock:
            if step.work:
                self.verify_step.observe(step.finished_s - step.drafts_s)
                if step.speculative:
                    self.draft_wait.observe(step.drafts_s - step.started_s)
                self._count_work(step)
            self._count_outputs(step.outputs, step.finished_s)
            self.running.value = step.running
            self.waiting.value = step.waiting
            self.kv_usage.value = step.kv_usage
            self.groups.value = step.groups
            self.ahead["hit"].value += step.ahead_hits
            self.ahead["miss"].value += step.ahead_misses

    # -- draft pool observer (a stream's reader thread) --------------------------------
    def round_trip(self, seconds: float) -> None:
        with self.recorder.lock:
            self.draft_rtt.observe(seconds)

    # -- internals ------------------------------------------------------------------------
    def _count_work(self, step: VerifierStepRecord) -> None:
        drafts = draft_tokens = accepted = prompt = 0
        per_pos = [0] * self.num_steps
        depths = [0] * (self.num_steps + 1)
        for item, verdict in zip(step.work, step.verdicts, strict=True):
            req = item.request
            times = self._requests.get(req.request_id)
            if times is not None and not times.scheduled:
                times.scheduled_s = step.drafts_s
                self.queue_time.observe(step.drafts_s - times.arrival_s)
            if item.kind is WorkKind.PREFILL:
                prompt += item.num_rows
                continue
            if step.speculative:
                depths[item.num_drafts] += 1
            if item.num_drafts:
                drafts += 1
                draft_tokens += item.num_drafts
                accepted += verdict.accepted
                for i in range(verdict.accepted):
                    per_pos[i] += 1
                if item.ahead:
                    self._count_ahead(item.num_drafts, verdict.accepted)
            elif step.speculative:
                self.fallbacks[req.draft_miss or "late"].value += 1
        self.prompt_tokens.value += prompt
        self.drafts.value += drafts
        self.draft_tokens.value += draft_tokens
        self.accepted.value += accepted
        for child, n in zip(self.accepted_per_pos, per_pos, strict=True):
            child.value += n
        for child, n in zip(self.depth, depths, strict=True):
            child.value += n

    def _count_ahead(self, drafts: int, accepted: int) -> None:
        self.ahead_draft_tokens.value += drafts
        for child in self.ahead_per_pos[:accepted]:
            child.value += 1

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
                    times.first_token_s = now
                else:
                    per_token = (now - times.last_token_s) / n
                    for _ in range(n):
                        self.itl.observe(per_token)
                times.last_token_s = now
                times.generated += n
            if out.finished:
                self.finished[out.finish_reason].value += 1
                if out.finish_reason in DONE and out.error is None:
                    self.e2e.observe(now - times.arrival_s)
                self._count_request(times)
                del self._requests[out.request_id]
        self.generation_tokens.value += generated

    def _count_request(self, t: _Times) -> None:
        """A finished request's histograms; phases it never reached are not observed."""
        self.request_prompt.observe(t.prompt_len)
        self.request_generation.observe(t.generated)
        if t.first_token_s is None:
            return
        if t.scheduled_s is not None:
            self.prefill_time.observe(t.first_token_s - t.scheduled_s)
            self.inference_time.observe(t.last_token_s - t.scheduled_s)
        self.decode_time.observe(t.last_token_s - t.first_token_s)
        if t.generated > 1:
            self.tpot.observe((t.last_token_s - t.first_token_s) / (t.generated - 1))


class DraftStatsCollector(Collector):
    """Counters the draft pool (`DraftPoolStats`) and the engine (resyncs, preemptions)
    keep as plain ints, read at scrape time (zeros until `VerifierMetrics.attach`)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.engine = None
        self.pool = None

    def collect(self):
        stats, m = getattr(self.pool, "stats", None), [self.model]

        def counter(name: str, doc: str, value) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(m, value)
            return family
        wire = CounterMetricFamily("chainspec_draft_transfer_bytes", "Draft stream payload "
                                   "bytes (protobuf), by direction", labels=["model_name",
                                                                             "direction"])
        wire.add_metric([self.model, "sent"], getattr(stats, "bytes_sent", 0))
        wire.add_metric([self.model, "received"], getattr(stats, "bytes_received", 0))
        yield wire
        yield counter("chainspec_draft_resyncs", "Drafter states rebuilt from the committed "
                      "prefix", getattr(self.engine, "resyncs", 0))
        yield counter("chainspec_num_preemptions", "Running requests that gave their KV "
                      "blocks back to be recomputed later (the pool ran out)",
                      getattr(self.engine, "preemptions", 0))
        cache = getattr(getattr(self.engine, "allocator", None), "cache", None)
        yield counter("chainspec_prefix_cache_queries", "Prompt tokens looked up in the "
                      "prefix cache (vLLM's prefix_cache_queries)", getattr(cache, "queries", 0))
        yield counter("chainspec_prefix_cache_hits", "Prompt tokens found in the prefix "
                      "cache, not prefilled (vLLM's prefix_cache_hits)",
                      getattr(cache, "hits", 0))
        yield counter("chainspec_draft_reassignments", "Sequences given to another drafter "
                      "after losing theirs", getattr(stats, "reassignments", 0))
        yield counter("chainspec_draft_prefix_affine", "Sequences opening from a prefix "
                      "hit sent to the drafter that was sent its blocks",
                      getattr(stats, "affine_hits", 0))
        yield counter("chainspec_draft_late_batches", "Draft answers that came after their "
                      "round deadline", getattr(stats, "late_batches", 0))
        yield counter("chainspec_draft_stream_failures", "Drafter streams that broke",
                      getattr(stats, "stream_failures", 0))
        connected = GaugeMetricFamily("chainspec_drafters_connected",
                                      "Drafters this verifier can use", labels=["model_name"])
        connected.add_metric(m, len(self.pool.loads()) if self.pool is not None else 0)
        yield connected
        wanted = GaugeMetricFamily("chainspec_drafters_wanted", "Drafters the membership "
                                   "lists for this verifier (connected or not)",
                                   labels=["model_name"])
        wanted.add_metric(m, getattr(self.pool, "wanted", lambda: 0)())
        yield wanted
        yield counter("chainspec_draft_reconnects", "Links to a listed drafter opened again "
                      "after their stream ended or a connect failed",
                      getattr(stats, "reconnects", 0))

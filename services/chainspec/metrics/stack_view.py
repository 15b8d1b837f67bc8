"""The stack's verifier metrics under vLLM's names (`vllm:`), summed over the verifiers,
for tools that read one vLLM server's /metrics (`vllm bench serve`, production-stack's
dashboards and KEDA triggers, llm-d): the gateway serves them (`gateway/metrics.py`).

`StackView.update(scrapes)` takes each verifier's exposition text (by member id) and
keeps the sums: counters and histograms stay monotonic as verifiers come and go (a
member that leaves keeps counting with its last values; one whose counters went back, a
restart, has its old values folded in first), gauges are the current sum (requests) or
mean (KV usage). `families(model_name)` yields them with vLLM's `model_name` label.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.parser import text_string_to_metric_families

# chainspec family -> its vLLM names (v1 engine, vllm/v1/metrics/loggers.py), by kind
COUNTERS = {
    "chainspec_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "chainspec_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "chainspec_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "chainspec_spec_decode_num_accepted_tokens_per_pos":
        ("vllm:spec_decode_num_accepted_tokens_per_pos",),
    "chainspec_prompt_tokens": ("vllm:prompt_tokens",),
    "chainspec_generation_tokens": ("vllm:generation_tokens",),
    "chainspec_request_success": ("vllm:request_success",),
    "chainspec_num_preemptions": ("vllm:num_preemptions",),
    "chainspec_prefix_cache_queries": ("vllm:prefix_cache_queries",),  # tokens
    "chainspec_prefix_cache_hits": ("vllm:prefix_cache_hits",),
}
HISTOGRAMS = {
    "chainspec_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # NOTE: vLLM renamed time_per_output_token to inter_token_latency; dashboards read both
    "chainspec_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                              "vllm:time_per_output_token_seconds"),
    "chainspec_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "chainspec_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "chainspec_request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "chainspec_request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "chainspec_request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "chainspec_request_time_per_output_token_seconds":
        ("vllm:request_time_per_output_token_seconds",),
    "chainspec_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "chainspec_request_generation_tokens": ("vllm:request_generation_tokens",),
}
GAUGES = {  # name -> (vLLM name, how verifiers combine)
    "chainspec_num_requests_running": ("vllm:num_requests_running", "sum"),
    "chainspec_num_requests_waiting": ("vllm:num_requests_waiting", "sum"),
    "chainspec_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "mean"),
}
DROP_LABELS = ("model_name",)  # set by the gateway (its served name, else the verifiers')
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}

Key = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, labels but model_name)


def parse(text: str) -> tuple[dict[Key, float], dict[Key, float], set[str]]:
    """One exposition's mapped samples: (monotonic ones: counters and histogram parts,
    gauges, the verifiers' model_name values)."""
    mono, gauges, names = {}, {}, set()
    for family in text_string_to_metric_families(text):
        kind = "counter" if family.name in COUNTERS else \
            "histogram" if family.name in HISTOGRAMS else \
            "gauge" if family.name in GAUGES else None
        if kind is None or family.type not in (kind, "unknown"):
            continue
        for s in family.samples:
            if kind != "gauge" and not s.name.endswith(SUFFIXES[kind]):
                continue  # _created
            names.add(s.labels.get("model_name", ""))
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in DROP_LABELS))
            (gauges if kind == "gauge" else mono)[(s.name, labels)] = s.value
    names.discard("")
    return mono, gauges, names


class StackView:
    """Sums of the verifiers' mapped metrics (see the module docstring)."""

    def __init__(self) -> None:
        self.live: dict[str, dict[Key, float]] = {}  # member -> its last counter values
        self.gone: dict[str, dict[Key, float]] = {}  # left the membership (may come back)
        self.folded: dict[Key, float] = defaultdict(float)  # from before restarts
        self.gauges: dict[str, dict[Key, float]] = {}
        self.model_names: set[str] = set()

    def update(self, scrapes: Mapping[str, str | None]) -> None:
        """`scrapes`: every current verifier's exposition (None: it did not answer this
        time, so its last values stand). Members not listed have left."""
        for member in set(self.live) - set(scrapes):
            self.gone[member] = self.live.pop(member)
            self.gauges.pop(member, None)
        for member, text in scrapes.items():
            if member in self.gone:  # back (a membership blip, or restarted)
                self.live[member] = self.gone.pop(member)
            try:
                mono, gauges, names = parse(text) if text is not None else (None, None, None)
            except ValueError:  # not an exposition (a proxy's error page): a missed scrape
                mono = None
            if mono is None:
                continue
            old = self.live.get(member, {})
            if any(mono.get(key, 0.0) < value for key, value in old.items()):
                for key, value in old.items():  # a restart: its counters began again
                    self.folded[key] += value
            self.live[member], self.gauges[member] = mono, gauges
            self.model_names |= names

    def totals(self) -> dict[Key, float]:
        out: dict[Key, float] = defaultdict(float, self.folded)
        for values in (*self.live.values(), *self.gone.values()):
            for key, value in values.items():
                out[key] += value
        return out

    def gauge(self, name: str, how: str) -> dict[tuple, float]:
        per_labels: dict[tuple, list[float]] = defaultdict(list)
        for values in self.gauges.values():
            for (sample, labels), value in values.items():
                if sample == name:
                    per_labels[labels].append(value)
        if not per_labels:
            return {(): 0.0}
        return {labels: sum(v) / (len(v) if how == "mean" else 1)
                for labels, v in per_labels.items()}

    def families(self, model_name: str = "") -> Iterator:
        """vLLM-named families, `model_name` on every sample (`model_name` given, else
        the verifiers' own)."""
        name = model_name or ",".join(sorted(self.model_names))
        totals = self.totals()
        for source, targets in COUNTERS.items():
            samples = _samples(totals, source + "_total") or {(): 0.0}
            for target in targets:
                yield _labelled(CounterMetricFamily, target, samples, name,
                                f"chainspec {source}, summed over the stack's verifiers")
        for source, targets in HISTOGRAMS.items():
            for target in targets:
                yield _histogram(target, source, totals, name)
        for source, (target, how) in GAUGES.items():
            yield _labelled(GaugeMetricFamily, target, self.gauge(source, how), name,
                            f"chainspec {source}, {how} over the stack's verifiers")


def _samples(totals: Mapping[Key, float], sample: str) -> dict[tuple, float]:
    return {labels: v for (name, labels), v in totals.items() if name == sample}


def _labelled(cls, name: str, samples: Mapping[tuple, float], model_name: str, doc: str):
    keys = sorted({k for labels in samples for k, _ in labels})
    family = cls(name, doc, labels=["model_name", *keys])
    for labels, value in sorted(samples.items()):
        values = dict(labels)
        family.add_metric([model_name, *(values.get(k, "") for k in keys)], value)
    return family


def _histogram(target: str, source: str, totals: Mapping[Key, float], model_name: str):
    family = HistogramMetricFamily(target, f"chainspec {source}, summed over the stack's "
                                   "verifiers", labels=["model_name"])
    buckets = sorted(((dict(labels)["le"], v) for labels, v in
                      _samples(totals, source + "_bucket").items()),
                     key=lambda b: float(b[0]))
    if buckets:
        total = _samples(totals, source + "_sum").get((), 0.0)
        family.add_metric([model_name], [(_le(le), v) for le, v in buckets], total)
    return family


def _le(bound: str) -> str:
    return "+Inf" if float(bound) == float("inf") else repr(float(bound))

"""The gateway's own Prometheus registry: answers by route and code, requests in flight,
time to the first token and request duration per generation route, and the verifiers
and drafters it can route to (read from its pool at scrape time). Also the stack's
verifier metrics under vLLM's `vllm:` names (`metrics/stack_view.py`), scraped from the
verifiers' endpoints when the gateway's /metrics is read (`StackCollector.refresh`)."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from chainspec.metrics.buckets import E2E_LATENCY_S, REQUEST_LATENCY_S
from chainspec.metrics.service import ServiceMetrics
from chainspec.metrics.stack_view import StackView

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
ROUTES = (*GENERATION_ROUTES, "/v1/models")


class GatewayMetrics(ServiceMetrics):
    def __init__(self, model: str = "") -> None:
        super().__init__(model)
        r = self.registry
        self.requests = Counter("chainspec_gateway_requests", "HTTP API requests answered",
                                ["route", "code"], registry=r)
        self.in_flight = Gauge("chainspec_gateway_in_flight_requests",
                               "Generation requests in flight through this gateway",
                               registry=r)
        self.ttft = Histogram("chainspec_gateway_time_to_first_token_seconds", "Request "
                              "received to response headers, which wait for the first token "
                              "(200 answers)", ["route"], buckets=REQUEST_LATENCY_S, registry=r)
        self.duration = Histogram("chainspec_gateway_request_duration_seconds", "Request "
                                  "received to the last byte of the answer (a stream: its "
                                  "end)", ["route"], buckets=E2E_LATENCY_S, registry=r)
        self.stream_resumes = Counter("chainspec_gateway_stream_resumes", "Generate "
                                      "streams resumed on another verifier after theirs "
                                      "failed mid-stream (one per resume)", registry=r)
        self.routing = RoutingCollector()
        r.register(self.routing)
        self.stack = StackCollector(model)
        r.register(self.stack)

    def observe(self, path: str, status: int) -> None:
        if path in ROUTES:  # bounded labels only
            self.requests.labels(path, str(status)).inc()

    def headers_sent(self, path: str, status: int, seconds: float) -> None:
        if path in GENERATION_ROUTES and status == 200:
            self.ttft.labels(path).observe(seconds)

    def answered(self, path: str, seconds: float) -> None:
        if path in GENERATION_ROUTES:
            self.duration.labels(path).observe(seconds)


class RoutingCollector(Collector):
    """Serving verifiers and the most drafters one of them uses, from the gateway's pool
    (`pool` set by the Gateway; read on the event loop, where /metrics runs)."""

    def __init__(self) -> None:
        self.pool = None

    def collect(self):
        views = [v for v in self.pool.views() if v.serving] if self.pool is not None else []
        verifiers = GaugeMetricFamily("chainspec_gateway_verifiers",
                                      "Verifiers serving behind this gateway")
        verifiers.add_metric([], len(views))
        drafters = GaugeMetricFamily("chainspec_gateway_drafters", "Most drafters a serving "
                                     "verifier is connected to")
        drafters.add_metric([], max((v.drafters for v in views), default=0))
        return [verifiers, drafters]


class StackCollector(Collector):
    """The verifiers' metrics under vLLM's names, summed (`StackView`), as of the last
    `refresh`; `model_name` the gateway's served name ("" = the verifiers')."""

    def __init__(self, model_name: str = "", timeout_s: float = 2.0) -> None:
        self.view, self.model_name, self.timeout_s = StackView(), model_name, timeout_s

    async def refresh(self, members: Iterable[dict[str, Any]]) -> None:
        """Scrape every live verifier member with a metrics endpoint, concurrently (one
        that does not answer in `timeout_s` keeps its last values)."""
        urls = {m["member_id"]: m["metrics_url"] for m in members
                if m.get("role") == "verifier" and m.get("metrics_url")
                and m.get("state") != "dead"}
        texts = await asyncio.gather(*(asyncio.to_thread(_scrape, url, self.timeout_s)
                                       for url in urls.values()))
        self.view.update(dict(zip(urls, texts, strict=True)))

    def collect(self):
        return self.view.families(self.model_name)


def _scrape(url: str, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read().decode()
    except (OSError, ValueError):
        return None

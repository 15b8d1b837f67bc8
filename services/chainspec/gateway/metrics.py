"""The gateway's own Prometheus registry (a later issue adds the full metric set)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("chainspec_gateway_requests", "HTTP API requests answered",
                                ["route", "code"], registry=self.registry)
        self.in_flight = Gauge("chainspec_gateway_in_flight_requests",
                               "Generation requests in flight through this gateway",
                               registry=self.registry)

    def observe(self, path: str, status: int) -> None:
        if path in ROUTES:  # bounded labels only
            self.requests.labels(path, str(status)).inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

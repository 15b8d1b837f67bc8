"""Serving one registry over HTTP for Prometheus (verifier and drafter processes; the
gateway serves its own on its API port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

WILDCARDS = ("0.0.0.0", "::", "[::]", "")


class MetricsEndpoint:
    """`GET /metrics` (any path, in fact) on host:port from a background thread; port 0
    takes a free one (`port` tells which)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        try:
            self._server, self._thread = start_http_server(port, host.strip("[]"), registry)
        except OSError as e:
            raise OSError(f"metrics: cannot listen on {host}:{port}: {e.strerror or e}") \
                from None
        self.host = host
        self.port: int = self._server.server_port

    def url(self, advertise: str | None = None) -> str:
        """`http://host:port/metrics`, with `advertise` for a wildcard bind address."""
        host = self.host if self.host not in WILDCARDS else (advertise or "127.0.0.1")
        host = f"[{host.strip('[]')}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

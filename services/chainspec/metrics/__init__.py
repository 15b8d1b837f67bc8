"""Prometheus metrics of the chainspec processes (DESIGN 4.6).

Each process owns one `CollectorRegistry` inside a role object (`VerifierMetrics`,
`DrafterMetrics`, the gateway's `GatewayMetrics`) that is passed down explicitly: the
engines take it as their observer (`engine/observer.py`), the gRPC shell as its call
interceptor, and `MetricsEndpoint` serves it over HTTP. Nothing registers globally, and
model code never sees it. Names, labels and buckets are listed in docs/design.md
("Metrics").
"""

"""The Recorder exports what its owner recorded as Prometheus families: counters with
`_total`, cumulative histogram buckets whose +Inf bucket is the count, constant labels."""

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from chainspec.metrics.recorder import Recorder


def test_recorder_exports_counters_gauges_and_histograms():
    rec = Recorder({"model": "m"})
    hits = rec.counter("x_hits", "Hits", "reason")
    a, b = hits.child("a"), hits.child("b")
    level = rec.gauge("x_level", "Level").child()
    lat = rec.histogram("x_seconds", "Latency", (0.1, 1.0)).child()
    registry = CollectorRegistry()
    registry.register(rec)
    with rec.lock:
        a.value += 2
        level.value = 7
        for x in (0.05, 0.1, 0.5, 3.0):
            lat.observe(x)
    get = registry.get_sample_value
    assert get("x_hits_total", {"model": "m", "reason": "a"}) == 2
    assert get("x_hits_total", {"model": "m", "reason": "b"}) == 0 and b.value == 0
    assert get("x_level", {"model": "m"}) == 7
    buckets = [get("x_seconds_bucket", {"model": "m", "le": le}) for le in ("0.1", "1.0", "+Inf")]
    assert buckets == [2, 3, 4]  # cumulative; 0.1 falls in le="0.1"
    assert get("x_seconds_count", {"model": "m"}) == 4
    assert get("x_seconds_sum", {"model": "m"}) == 3.65
    text = generate_latest(registry).decode()
    assert "# TYPE x_hits_total counter" in text and "# TYPE x_seconds histogram" in text

"""Metrics an engine updates every step, kept as plain numbers and exported at scrape.

prometheus_client takes a lock for every `inc`/`observe` (about a microsecond each); an
engine step records a few dozen values. A `Recorder` instead holds counters, gauges and
histograms as plain Python numbers that the writer updates inside one `with
recorder.lock:` block per step, and a scrape reads them under the same lock, so a scrape
never sees half a step (a histogram's buckets, sum and count always agree).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector


class Value:
    """A counter's or a gauge's child: update `.value` under the recorder's lock."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class Buckets:
    """A histogram's child: `observe(x)` under the recorder's lock."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, the last one is +Inf
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1  # x <= bounds[i]
        self.sum += x

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*map(repr, map(float, self.bounds)), "+Inf"), self.counts,
                            strict=True):
            total += n
            out.append((bound, total))
        return out


class _Family:
    def __init__(self, kind: str, name: str, doc: str, labels: Sequence[str],
                 buckets: Sequence[float] = ()) -> None:
        self.kind, self.name, self.doc, self.labels = kind, name, doc, tuple(labels)
        self.buckets = tuple(buckets)
        self.children: dict[tuple[str, ...], Value | Buckets] = {}

    def child(self, *values: str) -> Value | Buckets:
        if values not in self.children:
            self.children[values] = Buckets(self.buckets) if self.kind == "histogram" \
                else Value()
        return self.children[values]


class Recorder(Collector):
    """Families registered once; children (one per label value) created up front by the
    owner, updated under `lock`. `constant` labels (e.g. model) go on every sample."""

    def __init__(self, constant: dict[str, str]) -> None:
        self.lock = threading.Lock()
        self.constant = constant
        self._families: list[_Family] = []

    def counter(self, name: str, doc: str, *labels: str) -> _Family:
        return self._add(_Family("counter", name, doc, labels))

    def gauge(self, name: str, doc: str, *labels: str) -> _Family:
        return self._add(_Family("gauge", name, doc, labels))

    def histogram(self, name: str, doc: str, buckets: Sequence[float], *labels: str) -> _Family:
        return self._add(_Family("histogram", name, doc, labels, buckets))

    def _add(self, family: _Family) -> _Family:
        self._families.append(family)
        return family

    def collect(self):
        keys, fixed = list(self.constant), list(self.constant.values())
        with self.lock:
            for f in self._families:
                labels = [*keys, *f.labels]
                if f.kind == "counter":
                    out = CounterMetricFamily(f.name, f.doc, labels=labels)
                    for values, child in f.children.items():
                        out.add_metric([*fixed, *values], child.value)
                elif f.kind == "gauge":
                    out = GaugeMetricFamily(f.name, f.doc, labels=labels)
                    for values, child in f.children.items():
                        out.add_metric([*fixed, *values], child.value)
                else:
                    out = HistogramMetricFamily(f.name, f.doc, labels=labels)
                    for values, child in f.children.items():
                        out.add_metric([*fixed, *values], child.cumulative(), child.sum)
                yield out

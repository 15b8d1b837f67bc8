"""What the controller exports: the drafter autoscaler's decisions and the signals it
acted on (served on the controller's own metrics port, `controller_metrics_port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from chainspec.cluster.autoscale import AutoscalePolicy, Decision, Signals
from chainspec.metrics.service import ServiceMetrics

DIRECTIONS = ("up", "down")
KINDS = ("occupancy", "draft_wait", "bounds")


class ControllerMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.decisions = Counter("chainspec_drafter_autoscale_decisions",
                                 "Drafter autoscaling decisions, by direction and by what "
                                 "drove them", ["direction", "kind"], registry=r)
        for direction in DIRECTIONS:  # NOTE: every series exists from the start (rate())
            for kind in KINDS:
                self.decisions.labels(direction, kind)
        self.desired = Gauge("chainspec_drafters_desired", "Drafters the controller keeps "
                             "(not draining), fixed or autoscaled", registry=r)
        self.bounds = Gauge("chainspec_drafter_autoscale_bounds", "The autoscaling policy's "
                            "drafter bounds (absent: autoscaling off)", ["bound"], registry=r)
        self.occupancy = Gauge("chainspec_drafter_autoscale_occupancy", "Running sequences "
                               "per serving drafter / drafter capacity, last sample",
                               registry=r)
        self.draft_wait = Gauge("chainspec_drafter_autoscale_draft_wait_seconds", "Mean "
                                "draft wait per speculative round, last sample interval",
                                registry=r)
        self.last_decision = Gauge("chainspec_drafter_autoscale_last_decision_timestamp_"
                                   "seconds", "Wall time of the last decision", registry=r)

    def policy(self, policy: AutoscalePolicy | None) -> None:
        if policy is None:
            self.bounds.clear()
            return
        self.bounds.labels("min").set(policy.min_drafters)
        self.bounds.labels("max").set(policy.max_drafters)

    def sampled(self, signals: Signals) -> None:
        self.occupancy.set(signals.occupancy if signals.drafters else 0.0)
        if signals.draft_wait_s is not None:
            self.draft_wait.set(signals.draft_wait_s)

    def decided(self, decision: Decision) -> None:
        self.decisions.labels(decision.direction, decision.kind).inc()
        self.desired.set(decision.after)
        self.last_decision.set(decision.time)

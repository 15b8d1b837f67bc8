"""The controller's drafter autoscaling (a mixin of `Controller`, which owns the intent,
the members and the reconcile): the queries `autoscale_state` and `set_autoscale`, the
loop's start, and applying a decision -- stored in the intent before acting, logged,
counted on the controller's own metrics endpoint, then reconciled (scale-in drains)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from chainspec.cluster.autoscale import AutoscalePolicy, Decision
from chainspec.cluster.autoscale_loop import AutoscaleLoop
from chainspec.cluster.membership import Member
from chainspec.cluster.plain_target import refuse_drafters
from chainspec.metrics.controller import ControllerMetrics
from chainspec.metrics.endpoint import MetricsEndpoint

log = logging.getLogger(__name__)


class AutoscalingMixin:
    def _init_autoscaling(self) -> None:
        config = self.config
        _log_decisions()
        self.metrics = ControllerMetrics()
        self._endpoint = None
        if config.controller_metrics_port is not None:
            try:
                self._endpoint = MetricsEndpoint(self.metrics.registry, config.host,
                                                 config.controller_metrics_port)
            except OSError as e:  # NOTE: e.g. a fixed port the dead incarnation still held:
                log.error("controller metrics off: %s", e)  # the controller must come up
        self.autoscaler = AutoscaleLoop(self._member_list, self._handles.__getitem__,
                                        config.drafter_max_seqs, config.health_timeout_s,
                                        self._autoscaled, self.metrics.sampled)

    async def autoscale_state(self) -> dict[str, Any]:
        """The drafter autoscaling policy (None: a fixed count), its last decision, the
        desired drafter count and the latest sample of the signals."""
        latest = self.autoscaler.latest
        return {"policy": self.intent.autoscale, "last_decision": self.intent.last_decision,
                "desired": self.intent.replicas["drafter"],
                "signals": latest.to_dict() if latest is not None else None,
                "metrics_url": self._metrics_url()}

    async def set_autoscale(self, policy: dict[str, Any] | None) -> dict[str, Any]:
        """Autoscale drafters under `policy` (AutoscalePolicy fields; those left out keep
        the policy in force, else the config's, else the defaults), or stop autoscaling
        (None) at the current count."""
        configured = self.config.drafter.autoscale
        base = self.intent.autoscale or (configured.to_dict() if configured else {})
        parsed = AutoscalePolicy.from_dict({**base, **policy}) if policy is not None else None
        if parsed is not None and self.config.drafter.local:
            raise ValueError("this stack's drafter mode is local: no drafter actors to scale")
        if parsed is not None:
            await asyncio.to_thread(refuse_drafters, self.config)
        await self._recovered.wait()
        self._refuse_if_stopped()
        self.intent.autoscale = parsed.to_dict() if parsed is not None else None
        self._save()
        self._start_autoscaler()
        return await self.autoscale_state()

    def _start_autoscaler(self) -> None:
        stored, last = self.intent.autoscale, self.intent.last_decision
        policy = AutoscalePolicy(**stored) if stored is not None else None
        self.autoscaler.restart(policy, Decision.from_dict(last) if last is not None else None,
                                lambda: self.intent.replicas["drafter"])
        self.metrics.policy(policy)

    def _autoscaled(self, decision: Decision) -> None:
        """Store the decision and the new count, then start or drain drafters."""
        if self.intent.stopped or self.intent.autoscale is None:
            return
        self.intent.replicas["drafter"] = decision.after
        self.intent.last_decision = decision.to_dict()
        self._save()  # NOTE: before acting, like every change of the intent
        self.metrics.decided(decision)
        log.info("drafter autoscale %s %d -> %d: %s", decision.direction, decision.before,
                 decision.after, decision.reason)
        self._reconcile("drafter")

    def _refuse_if_stopped(self) -> None:
        if self.intent.stopped:
            raise ValueError("the stack is stopping (`chainspec down`): nothing to scale")

    def _close_metrics(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None

    def _member_list(self) -> list[Member]:
        return list(self._members.values())

    def _metrics_url(self) -> str | None:
        if self._endpoint is None:
            return None
        return self._endpoint.url(ray.util.get_node_ip_address())


def _log_decisions() -> None:
    """The controller's INFO lines (decisions, autoscaling turned off) go to its stderr
    (Ray keeps it in the worker's log file and, with log_to_driver, shows it in the
    driver); a Ray worker's root logger would drop INFO."""
    cluster = logging.getLogger("chainspec.cluster")
    if not cluster.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                               "%(message)s"))
        cluster.addHandler(handler)
        cluster.setLevel(logging.INFO)
        cluster.propagate = False

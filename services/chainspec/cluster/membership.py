"""The controller's view of one member: a plain value that travels to any process."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any


class MemberState(enum.StrEnum):
    STARTING = "starting"  # spawned or restarting; not serving yet
    READY = "ready"  # serving; verifiers route to it
    DRAINING = "draining"  # no new work; leaves once its load is 0 (or on timeout)
    DEAD = "dead"  # missed a health check or failed to start; Ray may bring it back


@dataclass
class Member:
    member_id: str  # "<role>-<n>", also the suffix of the actor's name
    role: str
    state: MemberState = MemberState.STARTING
    endpoint: str | None = None  # host:port of its gRPC service
    load: int = 0  # drafter: sequences held; verifier: requests running + waiting
    pid: int | None = None
    node: str | None = None  # node IP
    metrics_url: str | None = None
    restarts: int = 0  # times the controller saw it come back with a new pid
    error: str | None = None
    links: dict[str, str] | None = None  # a verifier's drafter endpoint -> link state
    drafter_mode: str | None = None  # a verifier's: remote (drafter actors) or local
    ranks: list[dict[str, Any]] | None = None  # a TP member's ranks: rank, pid, node, state

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["state"] = str(self.state)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Member:
        return cls(**{**data, "state": MemberState(data["state"])})

    def observe(self, info: dict[str, Any]) -> bool:
        """Apply a ping/registration answer; True when routing-relevant fields changed."""
        before = (self.state, self.endpoint)
        if self.pid is not None and info["pid"] != self.pid:
            self.restarts += 1
        self.pid, self.node, self.load = info["pid"], info["node"], info["load"]
        self.endpoint, self.error = info["endpoint"], info["error"]
        self.metrics_url = info.get("metrics_url", self.metrics_url)
        self.links = info.get("links", self.links)
        self.drafter_mode = info.get("drafter_mode", self.drafter_mode)
        self.ranks = info.get("ranks", self.ranks)
        if self.state is not MemberState.DRAINING:
            if info["error"]:
                self.state = MemberState.DEAD
            else:
                self.state = MemberState.READY if info["serving"] else MemberState.STARTING
        return (self.state, self.endpoint) != before

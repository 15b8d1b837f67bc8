"""What the controller means its stack to be, kept in Ray's GCS key-value store so that a
restarted controller picks up where the dead one stopped (DESIGN 4.4; the pattern of Ray
Serve's controller).

The controller writes its intent BEFORE it acts: desired replicas per role (scaled counts
included), the member-id counters, every member it spawned and has not yet seen gone,
which of those are draining, and the drafter autoscaling policy with its last decision.
Every action is redone from it: a restarted controller re-adopts the members it finds by
name, drains the draining ones again and spawns only what is missing. One JSON value per
stack namespace, written whole (a put is atomic).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from chainspec.cluster.config import MEMBER_ROLES, ROLES, StackConfig

KV_NAMESPACE = "chainspec"  # Ray internal-KV namespace; the key carries the stack's
MEMBER_NAME = re.compile(r"chainspec-(drafter|verifier)-\d+")  # actors the controller spawns


def actor_name(member_id: str) -> str:
    """The named, detached actor hosting `member_id` (in the stack's namespace)."""
    return f"chainspec-{member_id}"


def group_name(member_id: str) -> str:
    """The detached placement group of a TP member's ranks (in the stack's namespace)."""
    return f"{actor_name(member_id)}-ranks"


def role_of(member_id: str) -> str:
    return member_id.rsplit("-", 1)[0]


@dataclass
class Intent:
    stack_id: str  # one `up`; a stale intent of an older stack is never adopted
    replicas: dict[str, int]  # desired actors per role
    next_id: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEMBER_ROLES, 0))
    members: list[str] = field(default_factory=list)  # spawned, not yet known gone
    draining: list[str] = field(default_factory=list)
    stopped: bool = False  # `shutdown` began: a restart spawns nothing
    epoch: int = 0  # controller incarnations of this stack (versions stay monotonic)
    autoscale: dict | None = None  # the drafter AutoscalePolicy in force; None: fixed count
    last_decision: dict | None = None  # the autoscaler's last Decision
    group_sizes: dict[str, int] = field(default_factory=dict)  # member -> ranks (TP > 1)

    @classmethod
    def fresh(cls, config: StackConfig, stack_id: str) -> Intent:
        policy = config.drafter.autoscale
        return cls(stack_id, {role: config.role(role).replicas for role in ROLES},
                   autoscale=policy.to_dict() if policy is not None else None)

    def new_id(self, role: str) -> str:
        n = self.next_id.get(role, 0)
        self.next_id[role] = n + 1
        return f"{role}-{n}"

    def forget(self, member_id: str) -> bool:
        """Drop a member known gone; True if it was listed."""
        listed = member_id in self.members
        self.members = [m for m in self.members if m != member_id]
        self.draining = [m for m in self.draining if m != member_id]
        self.group_sizes.pop(member_id, None)
        return listed

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Intent:
        return cls(**json.loads(raw))


class IntentStore:
    """The intent of the stack in `namespace`, in the GCS key-value store (works in a
    driver, an actor, and over Ray Client)."""

    def __init__(self, namespace: str) -> None:
        self.key = f"{namespace}/intent"

    def load(self) -> Intent | None:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(self.key, namespace=KV_NAMESPACE)
        return Intent.from_json(raw) if raw else None

    def save(self, intent: Intent) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.key, intent.to_json(), overwrite=True,
                                     namespace=KV_NAMESPACE)

    def clear(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.key, namespace=KV_NAMESPACE)

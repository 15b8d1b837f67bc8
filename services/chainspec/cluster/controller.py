"""The controller: a named, detached Ray actor that keeps membership (DESIGN 4.4).

It spawns drafter and verifier actors as named, detached actors (they outlive it),
health-checks each with an actor ping, drains members on scale-down, and publishes
membership under a version counter that verifiers long-poll (`watch`) to follow drafters.
It is off the data path: requests flow verifier <-> drafter without it.

Its intent (`cluster/intent.py`) goes to Ray's GCS key-value store before it acts. Ray
restarts a dead controller (max_restarts=-1) with the same arguments; the new one reads
the intent, re-adopts the members it finds by name, drains the draining ones again and
spawns only what is missing, so a restart loses no member and no scaled count.

The periodic control calls (members' `ping`, `watch` long-polls, `register` heartbeats:
several a second for as long as the stack runs) record no Ray task events: each one would
otherwise be kept by Ray's GCS (up to 100k tasks), which grew ~1.5 MB a minute on an idle
stack.

Drafter autoscaling (`cluster/autoscale.py`, `cluster/autoscale_loop.py`): with a policy
in the intent, a loop samples the verifiers and, on a decision, stores it and the new
desired count in the intent, then reconciles (scale-in drains). A restarted controller
resumes the stored policy and honours the stored decision's cooldown. A fixed
`scale drafter N` turns autoscaling off. Decisions are logged and exported on the
controller's own metrics endpoint (`controller_metrics_port`).

Drain of one member: state DRAINING (version bump); for a drafter, wait until every ready
verifier has applied that version (routes nothing new there, moved its sequences away)
and its load is 0; then the member's server drains (new calls UNAVAILABLE, calls in
flight finish) and the actor is killed for good. Each wait is bounded by
`drain_timeout_s`; losing a drafter early costs speed only (DESIGN 3.4).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import ray
from ray.util.placement_group import (
    get_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from chainspec.cluster.actors import DrafterActor, VerifierActor
from chainspec.cluster.config import MEMBER_ROLES, ROLES, StackConfig
from chainspec.cluster.controller_autoscale import AutoscalingMixin
from chainspec.cluster.intent import (
    MEMBER_NAME,
    Intent,
    IntentStore,
    actor_name,
    group_name,
    role_of,
)
from chainspec.cluster.membership import Member, MemberState
from chainspec.cluster.plain_target import refuse_drafters

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # longest wait for new members to load their model
FORGET_AFTER = 10  # health timeouts after which a silent external member is dropped
TP_MIN_CPUS = 0.01  # a rank's bundle when the role asks for no CPUs (none may be empty)


class Controller(AutoscalingMixin):
    def __init__(self, config: StackConfig, stack_id: str = "") -> None:
        self.config = config
        self._members: dict[str, Member] = {}
        self._handles: dict[str, Any] = {}  # member_id -> actor handle
        self.applied: dict[str, int] = {}  # verifier member_id -> membership version applied
        self._changed = asyncio.Event()
        self._heartbeats: dict[str, float] = {}  # external member_id -> last register
        self._tasks: set[asyncio.Task] = set()
        self._store = IntentStore(config.namespace)
        self.intent = self._load_intent(stack_id)
        # NOTE: versions grow across incarnations, so a watcher's stale version (and its
        # acknowledgement) from the dead controller is always older than ours
        self.version = self.intent.epoch << 32
        self._recovered = asyncio.Event()
        self._init_autoscaling()
        for member_id in list(self.intent.members):
            self._adopt(member_id)
        self._save()
        self._start_task(self._recover())

    # -- queries ------------------------------------------------------------------------
    async def ping(self) -> dict[str, Any]:
        """This incarnation: pid, epoch (restarts of this stack's controller), version,
        metrics_url (None: off)."""
        return {"pid": os.getpid(), "epoch": self.intent.epoch, "version": self.version,
                "metrics_url": self._metrics_url()}

    async def members(self) -> list[dict[str, Any]]:
        await self._recovered.wait()
        return [m.to_dict() for m in self._members.values()]

    async def get_config(self) -> dict[str, Any]:
        return self.config.to_dict()

    @ray.method(enable_task_events=False)  # periodic: no task events (module docstring)
    async def watch(self, version: int, timeout_s: float = 10.0,
                    watcher: str | None = None) -> tuple[int, list[dict[str, Any]]]:
        """Membership once it differs from `version` (or after `timeout_s`). `watcher`
        (a verifier's member id) acknowledges that it has applied `version`."""
        await self._recovered.wait()
        if watcher is not None:
            self.applied[watcher] = version
        if version == self.version:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass
        return self.version, await self.members()

    async def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
        """Members once none is starting; raises with the states on timeout or failure."""
        deadline = time.monotonic() + timeout_s
        await self._recovered.wait()
        while any(m.state is MemberState.STARTING for m in self._members.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"members not ready after {timeout_s:.0f} s: "
                                   f"{self._summary()}")
            await asyncio.sleep(0.1)
        failed = [m for m in self._members.values() if m.state is MemberState.DEAD]
        if failed:
            raise RuntimeError(f"members failed to start: {self._summary()}")
        return await self.members()

    # -- membership ---------------------------------------------------------------------
    @ray.method(enable_task_events=False)
    async def register(self, member_id: str, info: dict[str, Any]) -> bool:
        """An actor reports in after (re)starting; False if it is not a member."""
        member = self._members.get(member_id)
        if member is None:
            return False
        if member_id in self._heartbeats:
            self._heartbeats[member_id] = time.monotonic()
        if member.observe(info):
            self._bump()
        return True

    async def join(self, role: str, info: dict[str, Any]) -> str:
        """A member run outside the controller (a gateway) joins; it stays alive by calling
        `register` at least every `health_timeout_s` and leaves with `leave`."""
        if role not in MEMBER_ROLES:
            raise ValueError(f"unknown role {role!r}; known: {', '.join(MEMBER_ROLES)}")
        member = Member(self.intent.new_id(role), role)
        self._save()
        self._members[member.member_id] = member
        self._heartbeats[member.member_id] = time.monotonic()
        member.observe(info)
        self._start_task(self._expire(member))
        self._bump()
        return member.member_id

    async def leave(self, member_id: str) -> None:
        self._remove(member_id)

    async def scale(self, role: str, n: int, wait: bool = True) -> list[dict[str, Any]]:
        """Start or drain `role` actors until `n` are not draining; with `wait`, return
        once the new ones are ready and the drained ones gone."""
        self.config.role(role)  # validates the role
        if n < 0:
            raise ValueError(f"replicas must be >= 0, got {n}")
        if role == "drafter" and self.config.drafter.local and n > 0:
            raise ValueError("this stack's drafter mode is local: every verifier drafts in "
                             "process, so there are no drafter actors to scale (start a "
                             "stack with drafter mode remote for that)")
        if role == "drafter" and n > 0:  # a model without MTP modules: say so, start none
            await asyncio.to_thread(refuse_drafters, self.config)
        await self._recovered.wait()
        self._refuse_if_stopped()
        if role == "drafter" and self.intent.autoscale is not None:  # a fixed count now
            log.info("drafter autoscaling off: scaled to a fixed %d", n)
            self.intent.autoscale = None
            self._start_autoscaler()
        self.intent.replicas[role] = n
        self._save()
        if role == "drafter":
            self.metrics.desired.set(n)
        started, drains = self._reconcile(role)
        if wait:
            await asyncio.gather(*drains)
            await self._wait_started(started)
        return await self.members()

    async def drain_members(self, member_ids: list[str]) -> list[dict[str, Any]]:
        """Drain these members now (a pod about to stop: the chart's preStop hook) and
        return once they are gone. The desired counts stay: each gets a replacement at
        once, which waits for room (a free pod) like any other actor."""
        await self._recovered.wait()
        self._refuse_if_stopped()
        known = {m for m, v in self._members.items() if v.role in ROLES}
        if unknown := sorted(set(member_ids) - known):
            raise ValueError(f"no drafter or verifier {', '.join(unknown)} in this stack; "
                             f"members: {', '.join(sorted(known)) or 'none'}")
        drains = []
        for member in (self._members[m] for m in member_ids):
            if member.state is not MemberState.DRAINING:
                self.intent.draining.append(member.member_id)
                self._save()  # NOTE: before acting, so a restart drains it again
                member.state = MemberState.DRAINING
                drains.append(self._start_task(self._drain(member)))
        for role in {role_of(m) for m in member_ids}:
            self._reconcile(role)
        await asyncio.gather(*drains)
        while any(m in self._members for m in member_ids):  # drained by an earlier call
            await asyncio.sleep(0.1)
        return await self.members()

    async def shutdown(self) -> None:
        """Kill every member (no restarts), adopted or not yet; a restart of this
        controller from now on spawns nothing."""
        self.intent.stopped = True
        self._save()
        self._recovered.set()  # NOTE: nobody waits forever on a recovery cancelled here
        self.autoscaler.stop()
        self._close_metrics()
        for task in list(self._tasks):
            task.cancel()
        for member_id in list(self._members):
            self._remove(member_id)
        _kill_members(self.config.namespace, self.intent.members)
        self.intent.members, self.intent.draining = [], []
        self._save()

    # -- recovery -----------------------------------------------------------------------
    def _load_intent(self, stack_id: str) -> Intent:
        """This stack's intent (a restart: one more epoch), else a fresh one; members an
        older stack in this namespace left behind are killed first."""
        intent = self._store.load()
        if intent is not None and intent.stack_id == stack_id:
            intent.epoch += 1
            return intent
        if intent is not None:
            _kill_members(self.config.namespace, intent.members)
        return Intent.fresh(self.config, stack_id)

    def _adopt(self, member_id: str) -> None:
        """Take back a member spawned by an earlier incarnation, if it still exists."""
        try:
            handle = ray.get_actor(actor_name(member_id), namespace=self.config.namespace)
        except ValueError:  # gone for good (killed, or out of restarts)
            _remove_group(member_id)  # a TP group's placement group, if one was left
            self.intent.forget(member_id)
            return
        member = Member(member_id, role_of(member_id))
        if member_id in self.intent.draining:
            member.state = MemberState.DRAINING
        self._members[member_id], self._handles[member_id] = member, handle

    async def _recover(self) -> None:
        """Ask the adopted members how they are before answering anyone (a verifier
        must not see its drafters as `starting` and drop their links), then resume."""
        adopted = list(self._members.values())
        await asyncio.gather(*(self._first_ping(m) for m in adopted))
        if not self.intent.stopped:
            for member in adopted:
                self._start_task(self._monitor(member))
                if member.state is MemberState.DRAINING:
                    self._start_task(self._drain(member))
            for role in ROLES:
                self._reconcile(role)
            self._start_autoscaler()
        self.metrics.desired.set(self.intent.replicas["drafter"])
        self._bump()
        self._recovered.set()

    async def _first_ping(self, member: Member) -> None:
        with contextlib.suppress(Exception):  # restarting or hung: the monitor decides
            info = await asyncio.wait_for(self._handles[member.member_id].ping.remote(),
                                          self.config.health_timeout_s)
            member.observe(info)

    def _reconcile(self, role: str) -> tuple[list[Member], list[asyncio.Task]]:
        """Spawn or drain `role` members until the desired count is not draining."""
        n = self.intent.replicas[role]
        active = [m for m in self._members.values()
                  if m.role == role and m.state is not MemberState.DRAINING]
        started = [self._spawn(role) for _ in range(n - len(active))]
        # drain the least loaded first, newest on ties
        victims = sorted(active, key=lambda m: (m.load, -_index(m)))[:max(0, len(active) - n)]
        return started, [self._start_task(self._drain(m)) for m in victims]

    # -- internals ----------------------------------------------------------------------
    def _spawn(self, role: str) -> Member:
        member = Member(self.intent.new_id(role), role)
        self.intent.members.append(member.member_id)
        self._save()  # NOTE: before the actor exists, so no restart can lose track of it
        rc = self.config.role(role)
        cls = DrafterActor if role == "drafter" else VerifierActor
        resources = role_resources(self.config, role, ray.cluster_resources())
        placement: dict[str, Any] = {"num_cpus": rc.num_cpus, "resources": resources}
        if rc.tensor_parallel_size > 1:  # a verifier's or a drafter's group
            self.intent.group_sizes[member.member_id] = rc.tensor_parallel_size
            self._save()  # NOTE: before the group exists, as above
            placement = member_group(member.member_id, rc, resources)
        handle = ray.remote(cls).options(
            name=actor_name(member.member_id), namespace=self.config.namespace,
            lifetime="detached", max_restarts=rc.max_restarts, num_gpus=rc.num_gpus,
            **placement).remote(member.member_id, self.config)
        self._members[member.member_id], self._handles[member.member_id] = member, handle
        self._start_task(self._monitor(member))
        self._bump()
        return member

    def _save(self) -> None:
        self._store.save(self.intent)


    async def _monitor(self, member: Member) -> None:
        """Ping the member every health interval; no answer in time marks it dead."""
        handle = self._handles[member.member_id]
        answered = time.monotonic()
        while member.member_id in self._members:
            try:
                info = await asyncio.wait_for(handle.ping.remote(), self.config.health_timeout_s)
                changed, answered = member.observe(info), time.monotonic()
            except Exception as e:  # RayActorError, timeout: crashed, restarting, hung
                # NOTE: a starting actor cannot answer before its imports are done, so it is
                # given start_timeout_s before its silence counts
                silent = time.monotonic() - answered
                changed = member.state is MemberState.READY or (
                    member.state is MemberState.STARTING
                    and silent > self.config.start_timeout_s)
                if changed:
                    member.error = f"missed a health check: {type(e).__name__}: {e}" \
                        if member.state is MemberState.READY else \
                        f"no answer for {silent:.0f} s while starting"
                    member.state = MemberState.DEAD
            if changed:
                self._bump()
            await asyncio.sleep(self.config.health_interval_s)

    async def _expire(self, member: Member) -> None:
        """An external member without a heartbeat for `health_timeout_s` is dead, and
        forgotten after FORGET_AFTER timeouts (a killed gateway rejoins under a new id)."""
        while member.member_id in self._members:
            late = time.monotonic() - self._heartbeats[member.member_id]
            if late > FORGET_AFTER * self.config.health_timeout_s:
                self._remove(member.member_id)
            elif late > self.config.health_timeout_s and member.state is MemberState.READY:
                member.state, member.error = MemberState.DEAD, f"no heartbeat for {late:.1f} s"
                self._bump()
            await asyncio.sleep(self.config.health_interval_s)

    async def _drain(self, member: Member) -> None:
        if member.member_id not in self.intent.draining:
            self.intent.draining.append(member.member_id)
            self._save()
        member.state = MemberState.DRAINING
        self._bump()
        version = self.version
        if member.role == "drafter":  # first the verifiers move its sequences elsewhere
            deadline = time.monotonic() + self.config.drain_timeout_s
            while time.monotonic() < deadline and not self._moved_off(member, version):
                await asyncio.sleep(min(0.1, self.config.health_interval_s))
        try:  # the server refuses new work and lets calls in flight finish (bounded)
            await asyncio.wait_for(self._handles[member.member_id].drain.remote(),
                                   self.config.drain_timeout_s + 5.0)
        except Exception:
            pass  # NOTE: gone or stuck: it is killed below either way
        self._remove(member.member_id)

    def _moved_off(self, drafter: Member, version: int) -> bool:
        """Every ready verifier applied `version` (no longer routes there), load is 0."""
        verifiers = [m.member_id for m in self._members.values()
                     if m.role == "verifier" and m.state is MemberState.READY]
        applied = all(self.applied.get(v, -1) >= version for v in verifiers)
        return applied and drafter.load == 0

    def _remove(self, member_id: str) -> None:
        handle = self._handles.pop(member_id, None)
        self._members.pop(member_id, None)
        self.applied.pop(member_id, None)
        self._heartbeats.pop(member_id, None)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        _remove_group(member_id)  # a TP verifier's ranks' bundles (its ranks died with it)
        if self.intent.forget(member_id):  # NOTE: after the kill, never before
            self._save()
        self._bump()

    async def _wait_started(self, started: list[Member]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while any(m.state is MemberState.STARTING for m in started):
            if time.monotonic() > deadline:
                raise TimeoutError(f"new members not ready: {self._summary()}")
            await asyncio.sleep(0.1)

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _start_task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _summary(self) -> str:
        return ", ".join(f"{m.member_id}={m.state}" + (f" ({m.error})" if m.error else "")
                         for m in self._members.values())


def role_resources(config: StackConfig, role: str, cluster: dict[str, float]
                   ) -> dict[str, float]:
    """The role's custom resource, only when the cluster declares it (else Ray could
    never place the actor)."""
    name = config.resource_name(role)
    return {name: config.role(role).resource_amount} if name in cluster else {}


def _index(member: Member) -> int:
    return int(member.member_id.rsplit("-", 1)[1])


def _kill_members(namespace: str, member_ids: list[str]) -> None:
    """Kill (no restarts) the listed members and any other member actor named in
    `namespace`: detached actors never die on their own."""
    names = {actor_name(m) for m in member_ids}
    names |= {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"] == namespace and MEMBER_NAME.fullmatch(a["name"])}
    for name in names:
        with contextlib.suppress(ValueError):  # already gone
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        _remove_group(name.removeprefix("chainspec-"))


def member_group(member_id: str, rc, resources: dict[str, float]) -> dict[str, Any]:
    """The actor options of a TP=N member (DESIGN 4.10): rank 0 in bundle 0 of a
    detached STRICT_PACK placement group of N bundles (one node), one per rank, each with
    the role's CPUs (at least a token share) and a GPU per rank on GPUs; the role's custom
    resource in bundle 0. Detached, so the group outlives a restarting controller; rank 0
    starts ranks 1.. in bundles 1.. itself (`cluster/tp_ranks.start_in_own_group`)."""
    cpus = max(rc.num_cpus, TP_MIN_CPUS)
    bundle = {"CPU": cpus, **({"GPU": 1.0} if rc.num_gpus > 0 else {})}
    bundles = [{**bundle, **resources}] + [dict(bundle) for _ in
                                           range(rc.tensor_parallel_size - 1)]
    pg = placement_group(bundles, strategy="STRICT_PACK", name=group_name(member_id),
                         lifetime="detached")
    return {"num_cpus": cpus, "resources": resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0)}


def _remove_group(member_id: str) -> None:
    """Remove a TP member's placement group (by name), if there is one."""
    with contextlib.suppress(Exception):  # none (TP = 1), or removed already
        remove_placement_group(get_placement_group(group_name(member_id)))

"""Ray hosting of a tensor-parallel group (DESIGN 4.10): one placement group of N
bundles packed on one node (STRICT_PACK), one process per device. Bundle 0 is rank 0's
(the caller: the verifier actor, a test's driver); ranks 1..N-1 are `TPRank` actors in
bundles 1..N-1, each loading only its shard and following rank 0 in lockstep
(`engine/tp_group.py`). The shell is thin: `serve` delegates to `follow`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from chainspec.engine.tp_group import (
    COLLECTIVE_TIMEOUT_S,
    DraftLeader,
    GroupAddress,
    TPLeader,
    follow,
    free_port,
    join,
    leave,
    one_thread,
)
from chainspec.engine.tp_launch import ShardSource, check_model

READY_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0)
class TPRank:
    """Rank `rank` > 0 of a group: `serve` runs until rank 0 says stop (or the group
    fails), returning the number of forwards it ran."""

    def __init__(self, address: GroupAddress, rank: int, source: ShardSource) -> None:
        self.address, self.rank = address, rank
        # NOTE: Ray shows each actor its own GPU, so a rank's device is its cuda:0
        self.source = dataclasses.replace(source, device="cuda:0") \
            if source.device == "cuda" else source

    def info(self) -> dict:
        """This rank's process: pid and node (asked before `serve`, which holds the actor)."""
        import os

        return {"rank": self.rank, "pid": os.getpid(), "node": ray.util.get_node_ip_address()}

    def serve(self) -> int:
        one_thread()
        tp, channel = join(self.address, self.rank)
        try:
            return follow(self.source.load(tp), channel, self.source.device_of(self.rank))
        finally:
            leave()


@dataclass
class RayGroup:
    """Rank 0's handle on a group of Ray ranks."""

    leader: TPLeader | DraftLeader
    pg: object
    ranks: list = field(default_factory=list)
    served: list = field(default_factory=list)  # ObjectRefs of the ranks' `serve`
    infos: list = field(default_factory=list)  # each rank > 0's pid and node
    owns_pg: bool = True  # False: the stack's placement group, removed by the controller

    def rank_states(self) -> list[dict]:
        """Every rank (0 = this process): rank, pid, node, state (alive; dead: its `serve`
        ended, which a live group's never does; hung: it did not answer rank 0's
        heartbeat, `engine/tp_channel.Channel`)."""
        import os

        ended, _ = ray.wait(self.served, num_returns=len(self.served), timeout=0)
        ended = set(ended)
        hung = self.leader.channel.unresponsive
        rows = [{"rank": 0, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                 "state": "alive"}]
        return rows + [{**info, "state": "dead" if ref in ended else
                        "hung" if info["rank"] in hung else "alive"}
                       for info, ref in zip(self.infos, self.served, strict=True)]

    def close(self) -> list[int]:
        """Stop the ranks; returns each rank's forward count (-1: it failed)."""
        counts = []
        try:
            self.leader.close()
        except RuntimeError:  # a rank is gone: nothing to tell it
            pass
        for ref in self.served:
            try:
                counts.append(ray.get(ref, timeout=30))
            except Exception:  # noqa: BLE001 (a dead or hung rank: killed below)
                counts.append(-1)
        for actor in self.ranks:
            ray.kill(actor)
        if self.owns_pg:
            remove_placement_group(self.pg)
        leave()
        return counts


def start_ray_group(model_dir: str | Path, world: int, dtype: torch.dtype = torch.float32,
                    device: str = "cpu", cache_len: int | None = None, draft: bool = False,
                    cpus_per_rank: float = 0.5,
                    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> RayGroup:
    """Reserve N bundles on one node, start ranks 1..N-1 in bundles 1.., join as rank 0."""
    check_model(model_dir, world, draft)
    bundle = {"GPU": 1.0} if device == "cuda" else {"CPU": cpus_per_rank}
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
    address = GroupAddress(ray.util.get_node_ip_address(), free_port(), world,
                           "nccl" if device == "cuda" else "gloo", collective_timeout_s)
    source = ShardSource(str(model_dir), dtype, device, cache_len, draft)
    ranks = [TPRank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=r)).remote(address, r, source)
        for r in range(1, world)]
    served = [rank.serve.remote() for rank in ranks]
    one_thread()
    tp, channel = join(address, 0)
    leader = (DraftLeader if draft else TPLeader)(source.load(tp), channel)
    return RayGroup(leader, pg, ranks, served)


_hosted: list[RayGroup] = []  # the group this process leads as rank 0 (a stack member)


def hosted_group() -> RayGroup | None:
    """The TP group this process leads, if it started one in its placement group."""
    return _hosted[-1] if _hosted else None


def start_in_own_group(source: ShardSource, world: int,
                       collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> RayGroup | None:
    """Rank 0 inside an actor placed in bundle 0 of a placement group of `world` bundles
    (the controller's, `cluster/controller.py`): ranks 1.. as `TPRank` actors in bundles
    1.., each asking for its bundle's CPUs and GPU (one a rank on GPUs). The ranks are
    owned by this actor, so they die with it and a restart replaces the whole group.
    None outside such a placement group."""
    from ray.util import get_current_placement_group

    pg = get_current_placement_group() if ray.is_initialized() else None
    if pg is None or len(pg.bundle_specs) < world:
        return None
    check_model(source.model_dir, world, source.draft)
    address = GroupAddress(ray.util.get_node_ip_address(), free_port(), world,
                           "nccl" if source.device == "cuda" else "gloo", collective_timeout_s)
    ranks = [TPRank.options(num_cpus=pg.bundle_specs[r].get("CPU", 0.0),
                            num_gpus=pg.bundle_specs[r].get("GPU", 0.0),
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                pg, placement_group_bundle_index=r)
                            ).remote(address, r, source) for r in range(1, world)]
    infos = [rank.info.remote() for rank in ranks]
    served = [rank.serve.remote() for rank in ranks]
    one_thread()
    tp, channel = join(address, 0)
    leader = (DraftLeader if source.draft else TPLeader)(source.load(tp), channel)
    group = RayGroup(leader, pg, ranks, served, ray.get(infos, timeout=READY_TIMEOUT_S),
                     owns_pg=False)
    _hosted.append(group)
    return group

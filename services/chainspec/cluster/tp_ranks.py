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

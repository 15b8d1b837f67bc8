"""Start a tensor-parallel group on this machine: rank 0 in the calling process, ranks
1..N-1 as spawned processes, each loading only its own shard (DESIGN 4.10).

This is the plain-process hosting (`generate`, `bench`, tests, benchmarks); the Ray
hosting puts the same ranks in actors of one placement group.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chainspec.engine.tp_channel import HEARTBEAT_S, IDLE_TIMEOUT_S
from chainspec.engine.tp_group import (
    COLLECTIVE_TIMEOUT_S,
    DraftLeader,
    GroupAddress,
    TPLeader,
    follow,
    join,
    leave,
    one_thread,
)
from chainspec.models.adapters import adapter_for, draft_config
from chainspec.models.config import ModelConfig, read_hf_config
from chainspec.models.tensor_parallel import TPError, check_divides
from chainspec.models.tp_loader import load_draft_shard, load_target_shard

JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ShardSource:
    """What every rank loads: its shard of `model_dir`'s target."""

    model_dir: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # "cuda": rank r on cuda:r
    cache_len: int | None = None
    draft: bool = False  # the MTP drafter's shard, not the target's

    def device_of(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device == "cuda" else self.device

    def load(self, tp) -> torch.nn.Module:
        load = load_draft_shard if self.draft else load_target_shard
        return load(self.model_dir, tp, self.dtype, self.device_of(tp.rank),
                    cache_len=self.cache_len).eval()


def _rank_main(address: GroupAddress, rank: int, source: ShardSource) -> None:
    one_thread()
    tp, channel = join(address, rank)
    try:
        follow(source.load(tp), channel, source.device_of(rank))
    finally:
        leave()


@dataclass
class LocalGroup:
    """Rank 0's handle on a group started by `start_local_group`."""

    leader: TPLeader | DraftLeader
    processes: list = field(default_factory=list)

    def close(self) -> None:
        try:
            self.leader.close()
        except RuntimeError:  # a rank is gone: nothing to tell it
            pass
        finally:
            for p in self.processes:
                p.join(JOIN_TIMEOUT_S)
                if p.is_alive():
                    p.kill()
            leave()


def check_model(model_dir: str | Path, world: int, draft: bool = False) -> None:
    """TPError in one line naming the model when `world` cannot shard it (`draft`: its
    MTP layers, as the drafter builds them; a model without any is not judged)."""
    try:
        hf = read_hf_config(model_dir)
        if not draft:
            check_divides(ModelConfig.from_hf(hf), world)
        elif (adapter := adapter_for(hf)) is not None:
            check_divides(draft_config(hf, adapter), world)
    except TPError as e:
        what = "its MTP layers: " if draft else ""
        raise TPError(f"{model_dir}: {what}{e}") from None


def start_local_group(model_dir: str | Path, world: int, dtype: torch.dtype = torch.float32,
                      device: str = "cpu", cache_len: int | None = None,
                      collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
                      draft: bool = False, idle_timeout_s: float = IDLE_TIMEOUT_S,
                      heartbeat_s: float = HEARTBEAT_S) -> LocalGroup:
    """Ranks 1..world-1 in spawned processes, rank 0 here; returns once every rank has
    joined. A step whose peer is lost raises (RuntimeError) within the timeout. `draft`:
    a group of the MTP drafter (rank 0 holds a `DraftLeader`). While idle, rank 0 asks
    every rank for an answer every `heartbeat_s`: a hung rank fails the group then."""
    source = ShardSource(str(model_dir), dtype, device, cache_len, draft)
    check_model(model_dir, world, draft)  # before spawning anything
    address = GroupAddress.local(world, "nccl" if device == "cuda" else "gloo",
                                 collective_timeout_s=collective_timeout_s,
                                 idle_timeout_s=idle_timeout_s, heartbeat_s=heartbeat_s)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(address, r, source), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    one_thread()
    tp, channel = join(address, 0)
    leader = (DraftLeader if draft else TPLeader)(source.load(tp), channel)
    return LocalGroup(leader, procs)

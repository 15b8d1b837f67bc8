"""A verifier member as a group of tensor-parallel ranks run in lockstep (DESIGN 4.10).

Rank 0 owns the `VerifierEngine` (scheduler, request state, sampling, acceptance, the
hidden rows exported to drafters). Its model is a `TPLeader`: before each forward (and
each LM-head call) it broadcasts the step's inputs -- ids, and the `AttnBatch` (positions,
slot mappings, block tables, state rows) or the dense shape -- to the other ranks, which
run the same call on their shard (`follow`); the row-parallel all-reduces inside the
layers join them. The KV cache is sized once, on rank 0; its geometry is sent before the
first paged step and every rank allocates its own heads' share.

Two process groups: steps' collectives time out after `collective_timeout_s`, so a lost
peer fails the step instead of hanging it; the command channel (gloo, host objects)
waits up to `idle_timeout_s` between steps, and rank 0 sends it a heartbeat while idle
that every rank must answer, so a hung rank fails an idle group too
(`engine/tp_channel.Channel`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from chainspec.engine.graph_runner import GraphKey
from chainspec.engine.tp_channel import HEARTBEAT_S, IDLE_TIMEOUT_S, Channel
from chainspec.engine.verify_graphs import VerifyGraphs
from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, PagedGroup
from chainspec.models.cache_spec import StateSpec
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.tensor_parallel import TPGroup

COLLECTIVE_TIMEOUT_S = 60.0
RENDEZVOUS_TIMEOUT_S = 60.0
CHUNK = 4096  # rows per message of the fingerprint stream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class GroupAddress:
    """Where the ranks of one group meet (rank 0's host and a free port)."""

    host: str
    port: int
    world: int
    backend: str = "gloo"  # "nccl" on GPUs
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    heartbeat_s: float = HEARTBEAT_S

    @classmethod
    def local(cls, world: int, backend: str = "gloo", **timeouts: float) -> GroupAddress:
        return cls("127.0.0.1", free_port(), world, backend, **timeouts)


def join(address: GroupAddress, rank: int) -> tuple[TPGroup, Channel]:
    """Join the group as `rank`: the step group and the command channel. Meeting waits
    up to `RENDEZVOUS_TIMEOUT_S` (the ranks start and import at their own pace); the
    step timeout starts with the first collective."""
    store = dist.TCPStore(address.host, address.port, address.world, is_master=rank == 0,
                          timeout=timedelta(seconds=max(RENDEZVOUS_TIMEOUT_S,
                                                        address.collective_timeout_s)))
    dist.init_process_group(address.backend, store=store, rank=rank,
                            world_size=address.world,
                            timeout=timedelta(seconds=address.collective_timeout_s))
    commands = dist.new_group(backend="gloo",
                              timeout=timedelta(seconds=address.idle_timeout_s))
    tp = TPGroup(rank, address.world, backend=address.backend)
    return tp, Channel(tp, commands, address.collective_timeout_s, address.idle_timeout_s,
                       address.heartbeat_s)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _batch_to(batch: AttnBatch, move: Callable[[torch.Tensor], torch.Tensor]) -> AttnBatch:
    states = batch.states
    if states is not None:
        states = dataclasses.replace(states, seq_starts=move(states.seq_starts),
                                     slot_ids=move(states.slot_ids),
                                     src_rows=move(states.src_rows),
                                     keep_flags=move(states.keep_flags))
    windows = {w: PagedGroup(move(g.slot_mapping), move(g.block_tables))
               for w, g in batch.windows.items()}
    return AttnBatch(move(batch.positions), move(batch.slot_mapping), move(batch.row_seq),
                     move(batch.block_tables), windows, states)


def cache_geometry(cache: ModelKVCache) -> dict:
    """What another rank needs to allocate its heads' share of the same cache."""
    slots, rows = 0, 1
    for i, spec in enumerate(cache.specs):
        if isinstance(spec, StateSpec):
            slots, rows = cache.state(i)[0].shape[:2]
            break
    first = cache.tensors()[0]
    return {"num_blocks": dict(cache.group_blocks), "block_size": cache.block_size,
            "state_slots": int(slots), "state_rows": int(rows), "dtype": first.dtype,
            "separate_windows": cache.separate_windows}


def _shared(shard: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's rows of the embedding and LM head (`engine/fingerprint.py`'s pair)."""
    embed = shard.model.embed_tokens if hasattr(shard, "model") else shard.embed_tokens
    return {"embed": embed.weight, "head": shard.lm_head.weight}


def group_fingerprint(shard: nn.Module, tp: TPGroup) -> str:
    """Rank 0: `weights_fingerprint` of the full embedding and head, hashed as a stream of
    every rank's rows in vocab order (received in chunks: no full copy is assembled),
    so it equals the fingerprint of the same checkpoint at TP=1."""
    h = hashlib.blake2b(digest_size=16)
    mine = _shared(shard)
    for name in sorted(mine):
        vocab = shard.config.vocab_size
        h.update(f"{name}:{[vocab, mine[name].shape[1]]};".encode())
        for rank in range(tp.world):
            rows = mine[name].detach() if rank == 0 else None
            if rows is None:
                count = torch.zeros(1, dtype=torch.int64)
                dist.recv(count, src=rank)
            for r0 in range(0, rows.shape[0] if rows is not None else int(count), CHUNK):
                if rows is not None:
                    chunk = rows[r0:r0 + CHUNK]
                else:
                    chunk = torch.empty(min(CHUNK, int(count) - r0), mine[name].shape[1])
                    dist.recv(chunk, src=rank)
                bits = chunk.to(torch.bfloat16).view(torch.int16)
                h.update(bits.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _send_rows(shard: nn.Module) -> None:
    """Ranks > 0: their rows of the fingerprinted pair, to rank 0, in chunks."""
    mine = _shared(shard)
    for name in sorted(mine):
        rows = mine[name].detach().float().cpu()
        dist.send(torch.tensor([rows.shape[0]], dtype=torch.int64), dst=0)
        for r0 in range(0, rows.shape[0], CHUNK):
            dist.send(rows[r0:r0 + CHUNK].contiguous(), dst=0)


class TPLeader(nn.Module):
    """Rank 0's model: the rank's shard, with every call mirrored to the other ranks.
    It reads like the `TargetModel` it wraps (config, family, cache_specs, logits)."""

    def __init__(self, shard: nn.Module, channel: Channel) -> None:
        super().__init__()
        self.shard = shard
        self.channel = channel
        self.config, self.family = shard.config, shard.family
        self._cache: ModelKVCache | None = None

    @property
    def tp(self) -> TPGroup:
        return self.shard.tp

    @property
    def attention_scale(self) -> float:
        return self.shard.attention_scale

    @property
    def graph_safe(self) -> bool:
        """A CUDA graph may capture the shard's forward when the group's collectives are
        NCCL's (device work a graph records; gloo's run on the host: eager) and its
        layers are graph safe. The step's inputs go to the other ranks outside the graph
        (`graph_peers`)."""
        return self.tp.backend == "nccl" and self.shard.graph_safe

    @property
    def graph_peers(self) -> GraphPeers:
        return GraphPeers(self)

    def cache_specs(self):
        return self.shard.cache_specs()

    def send_cache(self, cache: ModelKVCache) -> None:
        """The cache's geometry to the other ranks, once per cache."""
        if cache is not self._cache:
            self._cache = cache
            self.channel.send(("cache", cache_geometry(cache)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend
                ) -> torch.Tensor:
        if isinstance(backend, PagedAttention):
            self.send_cache(backend.cache)
            self.channel.send(("paged", input_ids, backend.batch,
                               backend.scale))
        elif isinstance(backend, DenseCausal):
            self.channel.send(("dense", input_ids, positions,
                               backend.batch_size, backend.seq_len, backend.scale))
        else:
            raise TypeError(f"no tensor-parallel mirror for {type(backend).__name__}")
        with self.channel.busy():
            return self.shard(input_ids, positions, backend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.channel.send(("logits", hidden))
        with self.channel.busy():
            return self.shard.logits(hidden)

    def fingerprint(self) -> str:
        """The pairing fingerprint of the whole model (`engine/fingerprint.py`)."""
        self.channel.send(("fingerprint",))
        with self.channel.busy():
            return group_fingerprint(self.shard, self.tp)

    def close(self) -> None:
        self.channel.send(("stop",))


class GraphPeers:
    """A TP leader's verify graphs on the other ranks (`engine/verify_graphs.py`): `model`
    is what this rank runs or captures (the shard, whose all-reduces are the graph's only
    collectives); `setup` has every other rank build the same static buffers and capture
    the same buckets in the same order; `replay` sends a bucket's filled view (host work,
    outside any graph) for them to copy into their buffers and replay alongside."""

    def __init__(self, leader: TPLeader) -> None:
        self.leader = leader

    @property
    def model(self) -> nn.Module:
        return self.leader.shard

    def setup(self, cache: ModelKVCache, max_seqs: int, num_steps: int, max_len: int,
              capture: bool) -> None:
        self.leader.send_cache(cache)
        self.leader.channel.send(("graphs", max_seqs, num_steps, max_len, capture))

    def replay(self, batch_size: int, ids: torch.Tensor, batch: AttnBatch) -> None:
        self.leader.channel.send(("replay", batch_size, ids, batch))


class DraftLeader(nn.Module):
    """Rank 0's MTP drafter: its shard, with each draft step and head call mirrored (the
    step's tokens, input states, positions and AttnBatch). `next_input` is local: every
    rank holds the replicated norms, and the next step's message carries its input."""

    def __init__(self, shard: nn.Module, channel: Channel) -> None:
        super().__init__()
        self.shard = shard
        self.channel = channel
        self.config, self.glue = shard.config, shard.glue
        self._cache: ModelKVCache | None = None

    @property
    def tp(self) -> TPGroup:
        return self.shard.tp

    @property
    def num_modules(self) -> int:  # the drafter service's Info
        return self.shard.num_modules

    def cache_specs(self, num_steps: int):
        return self.shard.cache_specs(num_steps)

    def next_input(self, step: int, g: torch.Tensor, h: torch.Tensor, chain: bool = True
                   ) -> torch.Tensor:
        return self.shard.next_input(step, g, h, chain)

    def step(self, step: int, tokens: torch.Tensor, prev: torch.Tensor,
             positions: torch.Tensor, backend: PagedAttention) -> torch.Tensor:
        if backend.cache is not self._cache:
            self._cache = backend.cache
            self.channel.send(("cache", cache_geometry(backend.cache),
                               backend.cache.num_layers))
        self.channel.send(("draft_step", step, tokens, prev, positions,
                           backend.batch, backend.scale))
        with self.channel.busy():
            return self.shard.step(step, tokens, prev, positions, backend)

    def logits(self, step: int, g: torch.Tensor) -> torch.Tensor:
        self.channel.send(("draft_logits", step, g))
        with self.channel.busy():
            return self.shard.logits(step, g)

    def fingerprint(self) -> str:
        self.channel.send(("fingerprint",))
        with self.channel.busy():
            return group_fingerprint(self.shard, self.tp)

    def close(self) -> None:
        self.channel.send(("stop",))


def follow(shard: nn.Module, channel: Channel, device: torch.device | str = "cpu") -> int:
    """A rank > 0: run rank 0's calls on this shard until it says stop; returns the
    number of forwards run."""
    cache: ModelKVCache | None = None
    graphs = None  # VerifyGraphs of this rank's shard, once rank 0 sets them up
    forwards = 0

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)
    with torch.inference_mode():
        while True:
            msg = channel.recv()
            kind = msg[0]
            if kind == "stop":
                return forwards
            if kind == "cache":  # a drafter's says its steps (one KV layer each)
                specs = shard.cache_specs(*msg[2:])
                cache = ModelKVCache(specs, device=device, **msg[1])
            elif kind == "paged":
                _, ids, batch, scale = msg
                batch = _batch_to(batch, move)
                shard(move(ids), batch.positions, PagedAttention(cache, batch, scale))
                forwards += 1
            elif kind == "dense":
                _, ids, positions, b, t, scale = msg
                shard(move(ids), move(positions), DenseCausal(b, t, scale))
                forwards += 1
            elif kind == "logits":
                shard.logits(move(msg[1]))
            elif kind == "draft_step":
                _, step, tokens, prev, positions, batch, scale = msg
                shard.step(step, move(tokens), move(prev), move(positions),
                           PagedAttention(cache, _batch_to(batch, move), scale))
                forwards += 1
            elif kind == "graphs":
                _, max_seqs, num_steps, max_len, capture = msg
                graphs = VerifyGraphs(shard, cache, max_seqs, num_steps, max_len,
                                      use_graphs=capture, static_on_cpu=True)
                graphs.capture()
            elif kind == "replay":
                _, size, ids, batch = msg
                graphs.buffers.fill(move(ids), _batch_to(batch, move), size)
                graphs.launch(GraphKey(size))
                forwards += 1
            elif kind == "fingerprint":
                _send_rows(shard)
            elif kind == "draft_logits":
                shard.logits(msg[1], move(msg[2]))
            elif kind == "ping":
                channel.answer()
            else:
                raise ValueError(f"unknown tensor-parallel command {kind!r}")


def one_thread() -> None:
    """One intra-op thread per rank (the ranks share the machine's cores)."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


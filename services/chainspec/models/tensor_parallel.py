"""Tensor parallelism as a transform of a built model (DESIGN 4.10; gpt-fast's habit).

The model code stays pure: `shard_target` takes a built `TargetModel` (normally with its
parameters on the meta device, see `empty_weights`) and rewrites it in place into rank r
of N, returning which slice of each checkpoint tensor the rank holds (`Shard`), so the
loader reads only that slice (`models/tp_loader.py`). The rules, per block:
- attention (GQA): q/k/v column-parallel by heads, o_proj row-parallel; KV heads split,
  or replicated (one per rank) when there are fewer KV heads than ranks. Each layer's
  cache spec then reports its local heads, so the KV cache is sharded by heads;
- sliding / head-gated attention: as GQA, plus sink logits and head gates by heads;
- MLA: by heads (q, kv_b column-parallel, o_proj row-parallel); the latent cache and
  the low-rank projections replicated;
- Gated DeltaNet: by key heads (with their value heads); the recurrent state is local;
- dense MLP: gate/up column-parallel, down row-parallel;
- MoE: experts split across the ranks (expert parallel), router replicated, shared
  expert as a dense MLP;
- one all-reduce per block (after o_proj, after down_proj), biases added once after it;
- embedding vocab-parallel (rows [v0, v1) per rank, one all-reduce), LM head
  vocab-parallel with the logits gathered on rank 0, which alone samples (the other
  ranks' `logits` return their own vocab rows only).
Norms, rotary tables and q/k norms are replicated. Layer kinds without a rule here are
refused by name (`TPError`), never silently replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from chainspec.kernels.fused_moe import fused_moe
from chainspec.models.gated_deltanet import GatedDeltaNet
from chainspec.models.layers import MLP, Attention
from chainspec.models.mla import LatentAttention
from chainspec.models.moe import Experts, SparseMoE
from chainspec.models.sliding_attention import SlidingAttention


class TPError(ValueError):
    """A model this group size cannot shard (one line naming what does not divide)."""


@dataclass
class CollectiveStats:
    """What the group's collectives cost (cumulative; benchmarks read and reset it)."""

    all_reduces: int = 0
    gathers: int = 0  # the LM head's, to rank 0
    seconds: float = 0.0
    broadcasts: int = 0  # rank 0's step-input messages (engine/tp_group.Channel)
    broadcast_seconds: float = 0.0  # packing and sending them

    def reset(self) -> None:
        self.all_reduces = self.gathers = self.broadcasts = 0
        self.seconds = self.broadcast_seconds = 0.0


@dataclass
class TPGroup:
    """Rank `rank` of `world`; `group` None: the default process group."""

    rank: int
    world: int
    group: object | None = None
    backend: str = "gloo"  # "nccl": collectives a CUDA graph can capture
    stats: CollectiveStats = field(default_factory=CollectiveStats)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.stats.all_reduces += 1
        self.stats.seconds += time.perf_counter() - t0
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x, on rank 0 (None on the others)."""
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0, group=self.group)
        self.stats.gathers += 1
        self.stats.seconds += time.perf_counter() - t0
        return parts


@dataclass(frozen=True)
class Shard:
    """Rows/columns [start, stop) along `dim` of a checkpoint tensor of shape `full`;
    with `more`, the rank's part is those ranges too, concatenated after it along `dim`
    (GDN's [q | k | v] projection: the rank's heads of each)."""

    dim: int
    start: int
    stop: int
    full: tuple[int, ...]
    more: tuple[tuple[int, int], ...] = ()

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.stop), *self.more)


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build modules with parameters on the meta device (no memory); buffers (rotary
    tables) stay real. The loader assigns each rank's slices afterwards."""
    register = nn.Module.register_parameter

    def meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)
    nn.Module.register_parameter = meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def even_split(size: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's share of `size` (ceil-sized shares; the last may be short)."""
    per = -(-size // world)
    return min(rank * per, size), min((rank + 1) * per, size)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input features are split."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPGroup,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class LocalExperts(nn.Module):
    """Experts [start, stop) of a MoE layer (expert parallel): only the (row, slot) pairs
    routed to them are computed; the others take id -1 (the fused kernel's "no expert
    here") and add nothing, so the sum over ranks is each row's full MoE output."""

    def __init__(self, start: int, stop: int, old: Experts) -> None:
        super().__init__()
        num, rows, hidden = old.gate_up_proj.shape
        device = old.gate_up_proj.device
        self.gate_up_proj = nn.Parameter(torch.empty(stop - start, rows, hidden, device=device))
        self.down_proj = nn.Parameter(torch.empty(stop - start, hidden, rows // 2,
                                                  device=device))
        self.start, self.stop, self.limit = start, stop, old.limit

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        local = ids - self.start  # [T, k]
        mine = (local >= 0) & (local < self.stop - self.start)
        return fused_moe(x, self.gate_up_proj, self.down_proj,
                         torch.where(mine, local, torch.full_like(local, -1)), weights,
                         self.limit)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding; ids outside embed to zero, then one sum."""

    def __init__(self, start: int, stop: int, dim: int, tp: TPGroup,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(stop - start, dim, device=device))
        self.start, self.stop, self.tp = start, stop, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)  # [T]
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)


class VocabParallelHead(nn.Module):
    """Logits of vocab rows [start, stop) per rank, gathered: [T, vocab] on rank 0, which
    alone samples; the other ranks get their own [T, ceil(vocab / N)] (zero-padded)."""

    def __init__(self, start: int, stop: int, vocab: int, dim: int, tp: TPGroup,
                 device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(stop - start, dim, device=device))
        self.vocab, self.tp = vocab, tp
        self.per_rank = -(-vocab // tp.world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)  # [T, stop - start]
        pad = self.per_rank - local.shape[-1]
        if pad:
            local = F.pad(local, (0, pad))
        parts = self.tp.gather(local)
        return local if parts is None else torch.cat(parts, dim=-1)[..., :self.vocab]


def head_split(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int, int]:
    """(first q head, q heads, first KV head, KV heads) of this rank."""
    n, r = tp.world, tp.rank
    if num_heads % n:
        raise TPError(f"tensor-parallel size {n} does not divide the {num_heads} "
                      f"attention heads")
    if num_kv_heads >= n:
        if num_kv_heads % n:
            raise TPError(f"tensor-parallel size {n} does not divide the {num_kv_heads} "
                          f"KV heads")
        per = num_kv_heads // n
        return r * num_heads // n, num_heads // n, r * per, per
    if n % num_kv_heads:
        raise TPError(f"{num_kv_heads} KV heads cannot be replicated over "
                      f"tensor-parallel size {n} (it must be a multiple)")
    return r * num_heads // n, num_heads // n, r * num_kv_heads // n, 1


class Sharder:
    """Rewrites modules into this rank's shard and records each parameter's `Shard`."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.shards: dict[str, Shard] = {}

    def column(self, parent: nn.Module, attr: str, prefix: str, start: int, stop: int,
               more: tuple[tuple[int, int], ...] = ()) -> None:
        """Output rows [start, stop) (and `more` ranges) of `parent.attr`."""
        old: nn.Linear = getattr(parent, attr)
        rows = stop - start + sum(b - a for a, b in more)
        new = nn.Linear(old.in_features, rows, bias=old.bias is not None,
                        device=old.weight.device)
        setattr(parent, attr, new)
        self.shards[f"{prefix}{attr}.weight"] = Shard(0, start, stop, tuple(old.weight.shape),
                                                      more)
        if old.bias is not None:
            self.shards[f"{prefix}{attr}.bias"] = Shard(0, start, stop, tuple(old.bias.shape),
                                                        more)

    def vector(self, parent: nn.Module, attr: str, prefix: str, start: int, stop: int
               ) -> None:
        """Entries [start, stop) of a 1-D parameter (per-head constants)."""
        old: nn.Parameter = getattr(parent, attr)
        setattr(parent, attr, nn.Parameter(torch.empty(stop - start, device=old.device)))
        self.shards[f"{prefix}{attr}"] = Shard(0, start, stop, tuple(old.shape))

    def gated_deltanet(self, gdn: GatedDeltaNet, prefix: str) -> None:
        """GDN by key heads (each with its Hv/Hk value heads): the rank's q, k and v
        rows of in_proj_qkv and of the depthwise conv, its value heads of z, b, a, dt_bias
        and A_log, out_proj row-parallel; the gated norm (over the head dim) replicated.
        Its recurrent state then holds the local heads only. Qwen3-Next's fused
        projections (`in_proj_qkvz`, `in_proj_ba`) are laid out per key head: the rank's
        key heads are one contiguous block of rows in each."""
        fused = hasattr(gdn, "in_proj_qkvz") and hasattr(gdn, "in_proj_ba")
        if not fused and type(gdn).make_projections is not GatedDeltaNet.make_projections:
            raise TPError(f"{prefix.rstrip('.')}: no tensor-parallel rule for the "
                          f"projections of {type(gdn).__name__} yet")
        s, n = gdn.shape, self.tp.world
        if s.num_k_heads % n:
            raise TPError(f"tensor-parallel size {n} does not divide the {s.num_k_heads} "
                          f"linear-attention key heads")
        nk, nv = s.num_k_heads // n, s.num_v_heads // n
        k0, v0 = self.tp.rank * nk, self.tp.rank * nv
        dk, dv = s.k_head_dim, s.v_head_dim
        q_rows = (k0 * dk, (k0 + nk) * dk)
        more = ((s.key_dim + k0 * dk, s.key_dim + (k0 + nk) * dk),
                (2 * s.key_dim + v0 * dv, 2 * s.key_dim + (v0 + nv) * dv))
        if fused:  # per key head: [q, k, v (r Dv), z (r Dv)] and [b (r), a (r)]
            r = s.num_v_heads // s.num_k_heads
            block = 2 * dk + 2 * r * dv
            self.column(gdn, "in_proj_qkvz", prefix, k0 * block, (k0 + nk) * block)
            self.column(gdn, "in_proj_ba", prefix, k0 * 2 * r, (k0 + nk) * 2 * r)
        else:
            self.column(gdn, "in_proj_qkv", prefix, *q_rows, more)
            self.column(gdn, "in_proj_z", prefix, v0 * dv, (v0 + nv) * dv)
            self.column(gdn, "in_proj_b", prefix, v0, v0 + nv)
            self.column(gdn, "in_proj_a", prefix, v0, v0 + nv)
        self.vector(gdn, "dt_bias", prefix, v0, v0 + nv)
        self.vector(gdn, "A_log", prefix, v0, v0 + nv)
        self.row(gdn, "out_proj", prefix, v0 * dv, (v0 + nv) * dv)
        old = gdn.conv1d
        local = 2 * nk * dk + nv * dv
        gdn.conv1d = nn.Conv1d(local, local, s.conv_kernel, bias=False, groups=local,
                               padding=s.conv_kernel - 1, device=old.weight.device)
        self.shards[f"{prefix}conv1d.weight"] = Shard(0, *q_rows, tuple(old.weight.shape), more)
        gdn.shape = dataclasses.replace(s, num_k_heads=nk, num_v_heads=nv)

    def row(self, parent: nn.Module, attr: str, prefix: str, start: int, stop: int,
            reduce: bool = True) -> None:
        """Input columns [start, stop) of `parent.attr`, reduced over the group (`reduce`
        False: a partial sum, reduced by the block that holds it)."""
        old: nn.Linear = getattr(parent, attr)
        if reduce:
            new = RowParallelLinear(stop - start, old.out_features, old.bias is not None,
                                    self.tp, old.weight.device)
        else:
            if old.bias is not None:
                raise TPError(f"{prefix}{attr}: a partial row-parallel linear with a bias")
            new = nn.Linear(stop - start, old.out_features, bias=False,
                            device=old.weight.device)
        setattr(parent, attr, new)
        self.shards[f"{prefix}{attr}.weight"] = Shard(1, start, stop, tuple(old.weight.shape))

    def attention(self, attn: Attention, prefix: str) -> None:
        q0, nq, k0, nk = head_split(attn.num_heads, attn.num_kv_heads, self.tp)
        q_rows = attn.q_proj.out_features // attn.num_heads  # head_dim (gated: 2 x)
        d = attn.head_dim
        self.column(attn, "q_proj", prefix, q0 * q_rows, (q0 + nq) * q_rows)
        self.column(attn, "k_proj", prefix, k0 * d, (k0 + nk) * d)
        self.column(attn, "v_proj", prefix, k0 * d, (k0 + nk) * d)
        self.row(attn, "o_proj", prefix, q0 * d, (q0 + nq) * d)
        attn.num_heads, attn.num_kv_heads = nq, nk

    def sliding(self, attn: SlidingAttention, prefix: str) -> None:
        """The sliding kind (and head_gated, its subclass) by heads as GQA: q/k/v
        column-parallel (values of their own width), o_proj row-parallel, sink logits and
        the head gate (`g_proj`, one row per query head) split by query heads; q/k norms
        (over the head dim) replicated. The window is each layer's own, unchanged."""
        s = attn.shape
        q0, nq, k0, nk = head_split(s.num_heads, s.num_kv_heads, self.tp)
        dk, dv = s.head_dim, s.v_head_dim
        self.column(attn, "q_proj", prefix, q0 * dk, (q0 + nq) * dk)
        self.column(attn, "k_proj", prefix, k0 * dk, (k0 + nk) * dk)
        self.column(attn, "v_proj", prefix, k0 * dv, (k0 + nk) * dv)
        self.row(attn, "o_proj", prefix, q0 * dv, (q0 + nq) * dv)
        if s.sinks:
            self.vector(attn, "attention_sink_bias", prefix, q0, q0 + nq)
        if getattr(attn, "head_gate", False):
            self.column(attn, "g_proj", prefix, q0, q0 + nq)
        attn.shape = dataclasses.replace(s, num_heads=nq, num_kv_heads=nk)

    def latent(self, attn: LatentAttention, prefix: str) -> None:
        """MLA by heads: q (q_proj or q_b_proj) and kv_b_proj column-parallel, o_proj
        row-parallel; the low-rank q_a / kv_a projections and the latent cache (one
        head of c_kv + k_rope) are replicated, as every head reads them."""
        s, n = attn.shape, self.tp.world
        if s.num_heads % n:
            raise TPError(f"tensor-parallel size {n} does not divide the {s.num_heads} "
                          f"attention heads")
        per = s.num_heads // n
        h0 = self.tp.rank * per
        qk, kv = s.qk_nope_head_dim + s.qk_rope_head_dim, s.qk_nope_head_dim + s.v_head_dim
        q_name = "q_proj" if s.q_lora_rank is None else "q_b_proj"
        self.column(attn, q_name, prefix, h0 * qk, (h0 + per) * qk)
        self.column(attn, "kv_b_proj", prefix, h0 * kv, (h0 + per) * kv)
        self.row(attn, "o_proj", prefix, h0 * s.v_head_dim, (h0 + per) * s.v_head_dim)
        attn.shape = dataclasses.replace(s, num_heads=per)

    def mlp(self, mlp: MLP, prefix: str, reduce: bool = True) -> None:
        size = mlp.gate_proj.out_features
        if size % self.tp.world:
            raise TPError(f"tensor-parallel size {self.tp.world} does not divide the "
                          f"intermediate size {size}")
        start, stop = even_split(size, self.tp.world, self.tp.rank)
        self.column(mlp, "gate_proj", prefix, start, stop)
        self.column(mlp, "up_proj", prefix, start, stop)
        self.row(mlp, "down_proj", prefix, start, stop, reduce)

    def moe(self, moe: SparseMoE, prefix: str) -> None:
        """Experts split across the ranks (expert parallel), the router replicated (every
        rank routes alike), a shared expert tensor-parallel; the block's partial sums
        (routed and shared) meet in one all-reduce, a forward hook on the block."""
        num, n = moe.cfg.router.num_experts, self.tp.world
        if num % n:
            raise TPError(f"tensor-parallel size {n} does not divide the {num} experts")
        start, stop = even_split(num, n, self.tp.rank)
        old = moe.experts
        moe.experts = LocalExperts(start, stop, old)
        for name in ("gate_up_proj", "down_proj"):
            self.shards[f"{prefix}experts.{name}"] = Shard(
                0, start, stop, tuple(getattr(old, name).shape))
        shared = getattr(moe, moe.cfg.shared_name, None) if moe.cfg.shared_intermediate_size \
            else None
        if shared is not None:
            if not isinstance(shared, MLP):
                raise TPError(f"{prefix}{moe.cfg.shared_name}: no tensor-parallel rule for "
                              f"{type(shared).__name__} yet")
            self.mlp(shared, f"{prefix}{moe.cfg.shared_name}.", reduce=False)
        tp = self.tp
        moe.register_forward_hook(lambda _m, _i, out: tp.all_reduce(out))

    def block(self, layer: nn.Module, prefix: str) -> None:
        """A decoder layer: its attention kind and its MLP kind, each by its rule."""
        for name, child in layer.named_children():
            if isinstance(child, Attention):
                self.attention(child, f"{prefix}{name}.")
            elif isinstance(child, GatedDeltaNet):
                self.gated_deltanet(child, f"{prefix}{name}.")
            elif isinstance(child, SlidingAttention):
                self.sliding(child, f"{prefix}{name}.")
            elif isinstance(child, LatentAttention):
                self.latent(child, f"{prefix}{name}.")
            elif isinstance(child, MLP):
                self.mlp(child, f"{prefix}{name}.")
            elif isinstance(child, SparseMoE):
                self.moe(child, f"{prefix}{name}.")
            elif any(True for _ in child.parameters()) and not _replicated(child):
                raise TPError(f"{prefix}{name}: no tensor-parallel rule for "
                              f"{type(child).__name__} yet")

    def vocab(self, embed: nn.Embedding, head: nn.Linear, tied: bool, embed_key: str,
              head_key: str) -> tuple[VocabParallelEmbedding, VocabParallelHead]:
        v, h = embed.weight.shape
        start, stop = even_split(v, self.tp.world, self.tp.rank)
        device = embed.weight.device
        new_embed = VocabParallelEmbedding(start, stop, h, self.tp, device)
        new_head = VocabParallelHead(start, stop, v, h, self.tp, device)
        if tied:
            new_head.weight = new_embed.weight
        self.shards[embed_key] = Shard(0, start, stop, (v, h))
        self.shards[head_key] = Shard(0, start, stop, tuple(head.weight.shape))
        return new_embed, new_head


def _replicated(module: nn.Module) -> bool:
    """Modules every rank holds whole (norms)."""
    return all(p.dim() <= 1 for p in module.parameters())


def shard_target(model: nn.Module, tp: TPGroup) -> dict[str, Shard]:
    """Rewrite a built `TargetModel` into rank `tp.rank`'s shard, in place; returns the
    checkpoint slice of every sharded parameter (state-dict key -> Shard)."""
    sharder = Sharder(tp)
    for i, layer in enumerate(model.model.layers):
        sharder.block(layer, f"model.layers.{i}.")
    embed, head = sharder.vocab(model.model.embed_tokens, model.lm_head,
                                model.config.tie_word_embeddings,
                                "model.embed_tokens.weight", "lm_head.weight")
    model.model.embed_tokens, model.lm_head = embed, head
    model.tp = tp
    return sharder.shards


def shard_draft(model: nn.Module, tp: TPGroup) -> dict[str, Shard]:
    """The same transform for an `MTPDraftModel`: each module's decoder block by its
    kinds' rules, the shared embedding and head vocab-parallel; the glue (enorm, hnorm,
    eh_proj, final norm) replicated."""
    sharder = Sharder(tp)
    if model.glue.own_heads:
        raise TPError("no tensor-parallel rule for MTP modules with their own heads yet")
    for i, module in enumerate(model.mtp):
        sharder.block(module.block, f"mtp.{i}.block.")
    model.embed_tokens, model.lm_head = sharder.vocab(
        model.embed_tokens, model.lm_head, model.config.tie_word_embeddings,
        "embed_tokens.weight", "lm_head.weight")
    model.tp = tp
    return sharder.shards


def check_divides(cfg, world: int) -> None:
    """Raise TPError (one line) when `world` cannot shard a model of `cfg`: the config's
    heads, KV heads and intermediate size (before anything is loaded)."""
    for rank in range(world):
        head_split(cfg.num_heads, cfg.num_kv_heads, TPGroup(rank, world))
    if cfg.intermediate_size % world:
        raise TPError(f"tensor-parallel size {world} does not divide the intermediate "
                      f"size {cfg.intermediate_size}")


def sharded_numel(model: nn.Module, shards: dict[str, Shard]) -> tuple[int, int]:
    """(elements this rank holds of the sharded parameters, their TP=1 elements);
    tied parameters counted once."""
    local = full = 0
    seen: set[int] = set()
    state = dict(model.named_parameters(remove_duplicate=False))
    for key, shard in shards.items():
        p = state[key]
        if id(p) in seen:
            continue
        seen.add(id(p))
        local += p.numel()
        full += int(torch.Size(shard.full).numel())
    return local, full

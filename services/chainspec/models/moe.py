"""The mixture-of-experts MLP kind: a router, stacked SwiGLU experts, optional shared experts.

Routers (`RouterConfig`, `route`), as transformers 5.x computes them:
- softmax (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): logits = x W^T in x's dtype, probabilities
  softmax in fp32, top-k of those; `norm_topk_prob` divides by their sum (Qwen3.5-MoE always);
  the weights are rounded to x's dtype, as transformers returns them.
- sigmoid (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash, MiMo-V2-Flash; `noaux_tc`): s = sigmoid(x W^T)
  in fp32; the choice is made on s + `e_score_correction_bias`, limited to the `topk_group`
  best of `n_group` groups (a group's score: the sum of its two best), the weights are the
  uncorrected s of the chosen experts, divided by their sum + 1e-20 with `norm_topk_prob`,
  times `routed_scaling_factor`.
NOTE (ties): choices are torch.topk's on bit-identical scores (same ops, same arguments,
`sorted=False` where transformers passes it), so ties break as transformers breaks them.
torch.topk's tie rule is its selection algorithm's, not "lowest index first" (on CPU,
zeros[16] top-4 is [10, 11, 12, 9]), and differs between CPU and CUDA.

Layer pattern (`sparse_layers`): which layers carry the MoE block, from `mlp_layer_types`
(GLM-4.7-Flash, MiMo-V2-Flash), `first_k_dense_replace` (DeepSeek-V3, GLM-4.5) or
`decoder_sparse_step` + `mlp_only_layers` (Qwen3-MoE, Qwen3-Next).

Parameters of `SparseMoE` (relative to the layer's `mlp.`; HF names, one to one):

| parameter | shape | checkpoint (fused layout: the same name) |
|---|---|---|
| `gate.weight` | [E, H] | same |
| `gate.e_score_correction_bias` | [E] fp32 | same (sigmoid routers) |
| `experts.gate_up_proj` | [E, 2I, H] | per expert: `experts.{e}.gate_proj.weight` [I, H] |
| | | (rows 0..I), `experts.{e}.up_proj.weight` [I, H] (rows I..2I) |
| `experts.down_proj` | [E, H, I] | per expert: `experts.{e}.down_proj.weight` [H, I] |
| `{shared}.gate_proj`, `.up_proj` | [Is, H] | same; `{shared}` is `shared_experts` |
| `{shared}.down_proj` | [H, Is] | (DeepSeek, GLM) or `shared_expert` (Qwen3-Next/3.5) |
| `shared_expert_gate.weight` | [1, H] | same (Qwen3-Next, Qwen3.5-MoE) |

Hugging Face checkpoints store experts per expert (transformers 5.x fuses them on load and
splits them on save); `expert_parts` tells the loader which layout a checkpoint uses. A
third layout stores each half stacked over the experts (Step-3.5-Flash: `moe.gate_proj.weight`
and `moe.up_proj.weight` [E, I, H]): a family whose `checkpoint_name` maps `gate_up_proj`
to `{prefix}.gate_up_proj` outside an `.experts` module reads it as their concatenation.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chainspec.kernels.fused_moe import fused_moe
from chainspec.models.errors import CheckpointError
from chainspec.models.layers import MLP

# Parameters kept in fp32 whatever the model dtype (as transformers keeps them): the
# correction bias separates experts by less than a bf16 ulp.
FP32_SUFFIXES = (".gate.e_score_correction_bias",)
SUPPORTED_TOPK_METHODS = ("noaux_tc",)


class Scoring(enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    norm_topk_prob: bool = False
    n_group: int = 1  # sigmoid routers: group-limited top-k
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_eps: float = 1e-20  # sigmoid norm_topk_prob: sum + norm_eps (Step-3.5: 0)
    fp32_weight: bool = False  # `gate.weight` loads in fp32 (MiMo-V2-Flash, as transformers)

    def __post_init__(self) -> None:
        e, k, g = self.num_experts, self.top_k, self.n_group
        if not 1 <= k <= e:
            raise CheckpointError(f"num_experts_per_tok={k} must be in 1..{e} (the experts)")
        if self.scoring is Scoring.SOFTMAX and (g != 1 or self.routed_scaling_factor != 1.0):
            raise CheckpointError(f"softmax router with n_group={g}, routed_scaling_factor="
                                  f"{self.routed_scaling_factor} is not supported")
        if g < 1 or e % g or (g > 1 and e // g < 2):
            raise CheckpointError(f"n_group={g} must divide n_routed_experts={e} into "
                                  f"groups of at least 2")
        if not 1 <= self.topk_group <= g or k > self.topk_group * (e // g):
            raise CheckpointError(f"topk_group={self.topk_group} must be in 1..{g} and keep "
                                  f"at least num_experts_per_tok={k} experts")

    @property
    def has_bias(self) -> bool:
        """Sigmoid routers carry `e_score_correction_bias`."""
        return self.scoring is Scoring.SIGMOID

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], scoring: Scoring, norm_default: bool
                ) -> RouterConfig:
        """From a config.json. `scoring` is what the family's transformers class computes;
        a `scoring_func` or `topk_method` saying otherwise fails naming it. `norm_default`:
        transformers' default of `norm_topk_prob` for the family (Qwen3-MoE False, the
        others True); a family that always normalises (Qwen3.5-MoE) passes it and
        overrides the field with `dataclasses.replace`."""
        func = cfg.get("scoring_func")
        if func is not None and func != scoring.value:
            raise CheckpointError(f"unsupported router scoring_func={func!r} (this family "
                                  f"routes with {scoring.value!r})")
        method = cfg.get("topk_method")
        if scoring is Scoring.SIGMOID and method not in (None, *SUPPORTED_TOPK_METHODS):
            raise CheckpointError(f"unsupported router topk_method={method!r}; supported: "
                                  f"{', '.join(SUPPORTED_TOPK_METHODS)}")
        norm = cfg.get("norm_topk_prob")
        sigmoid = scoring is Scoring.SIGMOID
        return cls(
            num_experts=int(num_experts(cfg)),
            top_k=int(cfg["num_experts_per_tok"]),
            scoring=scoring,
            norm_topk_prob=norm_default if norm is None else bool(norm),
            n_group=int(cfg.get("n_group") or 1) if sigmoid else 1,
            topk_group=int(cfg.get("topk_group") or 1) if sigmoid else 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0)
            if sigmoid else 1.0,
        )


def fp32_keys(model: nn.Module) -> set[str]:
    """State keys of router weights kept in fp32 whatever the load dtype (beside
    `FP32_SUFFIXES`): the routers whose config says `fp32_weight`."""
    return {f"{name}.weight" for name, m in model.named_modules()
            if isinstance(m, Router) and m.cfg.fp32_weight}


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts of a config (0: none): `num_experts`, `n_routed_experts` or
    `num_local_experts`, whichever the family names."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


@dataclass(frozen=True)
class MoEConfig:
    """One MoE block's shape: routed experts of width `intermediate_size` (the config's
    `moe_intermediate_size`), and shared experts of total width `shared_intermediate_size`
    (0: none; DeepSeek/GLM: moe_intermediate_size * n_shared_experts; Qwen3-Next:
    `shared_expert_intermediate_size`), gated by sigmoid(`shared_expert_gate`) or not."""

    router: RouterConfig
    hidden_size: int
    intermediate_size: int
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    shared_name: str = "shared_experts"  # Qwen3-Next, Qwen3.5: "shared_expert"
    expert_limit: float | None = None  # routed SwiGLU clamp (Step-3.5 `swiglu_limits`)
    output_scale: float = 1.0  # routed sum times this, after the experts (Step-3.5)

    def __post_init__(self) -> None:
        if self.shared_gate and not self.shared_intermediate_size:
            raise CheckpointError("shared_expert_gate without shared experts")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], scoring: Scoring, norm_default: bool) -> MoEConfig:
        """From a config.json (router: `RouterConfig.from_hf`). Shared experts: a gated
        `shared_expert` of `shared_expert_intermediate_size` where the config has one
        (Qwen3-Next, Qwen3.5-MoE), else `shared_experts` of width moe_intermediate_size *
        `n_shared_experts` (DeepSeek-V3, GLM), else none (Qwen3-MoE, MiMo-V2-Flash). A
        family whose transformers class differs overrides with `dataclasses.replace`."""
        router = RouterConfig.from_hf(cfg, scoring, norm_default)
        hidden, width = int(cfg["hidden_size"]), int(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            return cls(router, hidden, width, int(cfg["shared_expert_intermediate_size"]),
                       shared_gate=True, shared_name="shared_expert")
        return cls(router, hidden, width, int(cfg.get("n_shared_experts") or 0) * width)


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None,
          cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate_weight [E, H], bias [E] (sigmoid routers) -> (topk_ids [T, k] int64,
    topk_weights [T, k] fp32). Pure; the same decisions as transformers (module docstring)."""
    if cfg.scoring is Scoring.SOFTMAX:
        return _route_softmax(x, gate_weight, cfg)
    assert bias is not None, "sigmoid routers need e_score_correction_bias"
    return _route_sigmoid(x, gate_weight, bias, cfg)


def _route_softmax(x: torch.Tensor, gate_weight: torch.Tensor, cfg: RouterConfig
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x, gate_weight)  # [T, E] in x's dtype
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, cfg.top_k, dim=-1)  # [T, k]
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top.to(logits.dtype).float()


def _route_sigmoid(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor,
                   cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()  # [T, E]
    choice = scores + bias.float()
    if cfg.n_group > 1:
        choice = _keep_best_groups(choice, cfg.n_group, cfg.topk_group)
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + cfg.norm_eps)
    return ids, weights * cfg.routed_scaling_factor


def _keep_best_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice [T, E] with the experts outside the `topk_group` best groups set to -inf."""
    rows, experts = choice.shape
    grouped = choice.view(rows, n_group, experts // n_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    best = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(rows, experts)
    return choice.masked_fill(~keep, float("-inf"))


class Router(nn.Module):
    """`mlp.gate`: the router's weight and (sigmoid routers) its correction bias."""

    def __init__(self, cfg: RouterConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden_size))
        if cfg.has_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weight, getattr(self, "e_score_correction_bias", None), self.cfg)


class Experts(nn.Module):
    """`mlp.experts`: E SwiGLU experts stacked (transformers 5.x layout)."""

    def __init__(self, num: int, hidden_size: int, intermediate_size: int,
                 limit: float | None = None) -> None:
        super().__init__()
        self.limit = limit  # silu(gate) <= limit, |up| <= limit (None: plain SwiGLU)
        self.gate_up_proj = nn.Parameter(torch.zeros(num, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> [T, H]: kernels/fused_moe.py (Triton on CUDA)."""
        return fused_moe(x, self.gate_up_proj, self.down_proj, ids, weights, self.limit)


@dataclass(frozen=True)
class _MLPShape:
    """What layers.MLP reads of a config, for the shared experts' width."""

    hidden_size: int
    intermediate_size: int
    mlp_bias: bool = False


class SparseMoE(nn.Module):
    """The MoE MLP kind: forward(x [T, H]) -> [T, H]. Keeps no state between steps.
    `shared`: the family's own shared-expert module (Step-3.5: a clamped SwiGLU) in place
    of the plain SwiGLU of `shared_intermediate_size`."""

    def __init__(self, cfg: MoEConfig, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg.router, cfg.hidden_size)
        self.experts = Experts(cfg.router.num_experts, cfg.hidden_size, cfg.intermediate_size,
                               cfg.expert_limit)
        if cfg.shared_intermediate_size:
            shape = _MLPShape(cfg.hidden_size, cfg.shared_intermediate_size)
            self.add_module(cfg.shared_name,
                            shared or MLP(shape))  # type: ignore[arg-type]
        if cfg.shared_gate:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)  # [T, k] each
        out = self.experts(x, ids, weights)  # [T, H]
        if self.cfg.output_scale != 1.0:
            out = out * self.cfg.output_scale
        if not self.cfg.shared_intermediate_size:
            return out
        shared = getattr(self, self.cfg.shared_name)(x)  # [T, H]
        if self.cfg.shared_gate:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared


# ---------------------------------------------------------------------------------------
# Layer patterns.


def sparse_layers(cfg: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Per decoder layer, whether its MLP is the MoE block (transformers' rule for the key
    the config carries). An unsupported pattern fails with one line naming the key."""
    if num_experts(cfg) == 0:
        return (False,) * num_layers
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if len(types) != num_layers or set(types) - {"dense", "sparse"}:
            raise CheckpointError(f"unsupported mlp_layer_types {types!r}: need "
                                  f"{num_layers} entries of 'dense' or 'sparse'")
        return tuple(t == "sparse" for t in types)
    if cfg.get("first_k_dense_replace") is not None:
        freq = cfg.get("moe_layer_freq", 1)
        if freq != 1:
            raise CheckpointError(f"unsupported moe_layer_freq={freq!r} (transformers "
                                  f"ignores it; only 1 is supported)")
        first = int(cfg["first_k_dense_replace"])
        return tuple(i >= first for i in range(num_layers))
    step = int(cfg.get("decoder_sparse_step", 1) or 0)
    if step < 1:
        raise CheckpointError(f"unsupported decoder_sparse_step={step}")
    dense = set(cfg.get("mlp_only_layers") or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


# ---------------------------------------------------------------------------------------
# Checkpoint layout of the stacked experts.

_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<param>gate_up_proj|down_proj)$")
ReadFn = Callable[[str, tuple[int, ...]], torch.Tensor]


@dataclass(frozen=True)
class ExpertParts:
    """A stacked expert parameter stored per expert: the tensors that make it up."""

    name: str  # the stacked name, e.g. model.layers.3.mlp.experts.gate_up_proj
    shape: tuple[int, ...]  # [E, 2I, H] or [E, H, I]
    per_expert: tuple[tuple[str, ...], ...]  # [E][gate, up] or [E][down]; halves: [1][gate, up]
    halves: bool = False  # each part holds every expert: [E, I, H], joined on dim 1

    @property
    def names(self) -> list[str]:
        return [n for parts in self.per_expert for n in parts]

    def read(self, read: ReadFn) -> torch.Tensor:
        """Stack the per-expert tensors (`read(name, shape)` checks each one's shape)."""
        num, rows, cols = self.shape
        if self.halves:
            return torch.cat([read(n, (num, rows // 2, cols)) for n in self.per_expert[0]], 1)
        piece = (rows // len(self.per_expert[0]), cols)
        return torch.stack([torch.cat([read(n, piece) for n in parts], dim=0)
                            for parts in self.per_expert])


def expert_parts(name: str, shape: tuple[int, ...], present: Collection[str]
                 ) -> ExpertParts | None:
    """How checkpoint tensor `name` (a parameter's checkpoint name) is stored: None when it
    is stored as is (fused experts, or not an expert tensor), else its per-expert parts."""
    match = _STACKED.match(name)
    if name in present:
        return None
    halved = _HALVED.match(name)
    if match is None and halved is not None:
        pieces = tuple(f"{halved['prefix']}.{p}.weight" for p in ("gate_proj", "up_proj"))
        return ExpertParts(name, tuple(shape), (pieces,), halves=True)
    if match is None:
        return None
    prefix, param = match["prefix"], match["param"]
    pieces = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
    beyond = f"{prefix}.{shape[0]}.{pieces[0]}.weight"
    if beyond in present:
        raise CheckpointError(f"tensor {beyond}: more experts than the config's {shape[0]}")
    per_expert = tuple(tuple(f"{prefix}.{e}.{p}.weight" for p in pieces)
                       for e in range(shape[0]))
    return ExpertParts(name, tuple(shape), per_expert)


_HALVED = re.compile(r"^(?P<prefix>.*)\.gate_up_proj$")  # outside `.experts`: stacked halves
_HALF = re.compile(r"^(?P<prefix>.*)\.(gate_proj|up_proj)\.weight$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.\d+\.(?P<piece>gate_proj|up_proj|down_proj)"
                         r"\.weight$")


def stacked_name(name: str) -> str | None:
    """The stacked parameter a per-expert checkpoint tensor belongs to (None: not one)."""
    match = _PER_EXPERT.match(name)
    if match is None:
        half = _HALF.match(name)  # a stacked half (Step-3.5's moe.gate_proj.weight)
        return f"{half['prefix']}.gate_up_proj" if half else None
    param = "down_proj" if match["piece"] == "down_proj" else "gate_up_proj"
    return f"{match['prefix']}.{param}"

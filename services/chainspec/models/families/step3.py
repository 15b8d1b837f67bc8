"""The Step-3.5/3.7-Flash family (`Step3p5ForCausalLM`; transformers' `step3p7` text
model, config model_type `step3p5`).

Layer pattern: `layer_types` (`full_attention` / `sliding_attention`). Both kinds are the
`head_gated` attention of `models/head_gated_attention.py` with their own shape:
- `full`: `num_attention_heads` heads, no window, RoPE `rope_parameters["full_attention"]`
  (the hub's `rope_scaling` applies to this kind only);
- `sliding`: `num_sliding_attention_heads` heads (the hub's
  `attention_other_setting.num_attention_heads`), window `sliding_window` (a row sees
  that many keys, itself included), no sinks, RoPE `rope_parameters["sliding_attention"]`;
- both: `num_key_value_heads` (hub: `num_attention_groups`) kv heads, zero-centred q/k
  norms, a sigmoid gate per head (`g_proj`), scale `query_pre_attn_scalar ** -0.5`,
  partial RoPE per kind.
MLP kinds by `mlp_layer_types` (hub: `moe_layers_enum`): `dense` (SwiGLU clamped by
`swiglu_limits_shared[layer]`, none when 0 or absent); `sparse`: `models/moe.py`'s
SparseMoE as transformers' `Step3p7SparseMoeBlock` computes it:
- router: sigmoid(x W^T) in fp32, top-`moe_top_k` of it + the correction bias (no groups),
  weights the uncorrected scores divided by their plain sum (`norm_eps` 0: no 1e-20);
- `moe_num_experts` routed experts of `moe_intermediate_size`, SwiGLU clamped by
  `swiglu_limits[layer]` (`expert_limit`); their sum times `moe_router_scaling_factor`
  *after* the experts (`output_scale`);
- one shared expert of `share_expert_dim`, the dense layers' clamped SwiGLU
  (`swiglu_limits_shared[layer]`), added unscaled.
Refused by name: `moe_router_activation` other than sigmoid, `use_moe_router_bias` false.
The hub stores the MoE block as (`checkpoint_name`), relative to `model.layers.{i}.`:

| chainspec / transformers | hub |
|---|---|
| `mlp.gate.weight` [E, H] | `moe.gate.weight` |
| `mlp.gate.e_score_correction_bias` [E] | `moe.router_bias` |
| `mlp.experts.gate_up_proj` [E, 2I, H] | `moe.gate_proj.weight`, `moe.up_proj.weight` [E, I, H] |
| `mlp.experts.down_proj` [E, H, I] | `moe.down_proj.weight` |
| `mlp.shared_experts.{gate,up,down}_proj.weight` | `share_expert.{gate,up,down}_proj.weight` |
Every RMSNorm scales by (1 + w): chainspec's `RMSNorm` with `unit_offset`, so checkpoint
tensors load unchanged. The hub pads the per-layer lists with the MTP layers' entries
(`num_hidden_layers + num_nextn_predict_layers` long); they are split off here, as
transformers does (`mtp_layer_types`, `mtp_mlp_layer_types`).

MTP glue (the hub's `model.layers.{N+i}.*`, N = `num_hidden_layers`; SGLang
`step3p5_mtp.py` with its multi-layer EAGLE worker, vLLM `step3p5_mtp.py`, mlx-lm):

| | |
|---|---|
| tensors | `enorm`, `hnorm`, `eh_proj`, the decoder block's own names (`self_attn.*`, |
| | `mlp.*`, `input_layernorm`, `post_attention_layernorm`), `shared_head.norm`, |
| | `shared_head.output` (the layer's own LM head, as SGLang and vLLM load it) per |
| | layer; the embedding shared with the target (a per-layer copy is ignored) |
| count | `num_nextn_predict_layers` (3 released: layers 45/46/47); step k uses layer |
| | (k-1) mod L |
| concat | [enorm(emb), hnorm(hidden)]; all three glue norms zero-centred (1 + w) |
| hidden read | h *before* the target's final norm (SGLang sets |
| | `return_hidden_states_before_norm`; mlx-lm passes the pre-norm h); so this family |
| | exports that h and applies the norm in `TargetModel.logits` |
| token offset | step k at row p reads x[p+k] (SGLang rotates the input ids once per step) |
| chain | **yes**: step k reads g[k-1], step k-1's block output before its |
| | `shared_head.norm` (SGLang's `chain_mtp_hidden_states`, sglang#18564/#22041) |
| layer kind | one `head_gated` layer of kind `mtp_layer_types` (hub: `sliding_attention`: |
| | window, sliding heads) + dense SwiGLU; every MTP layer of one kind |

Where the references differ: transformers' generic `MtpModel` feeds the target's h after
its final norm and chains each layer's *normed* output; SGLang (StepFun's engine code) and
mlx-lm feed the pre-norm tensors, which is followed here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chainspec.models.adapters import STEP3
from chainspec.models.cache_spec import CacheSpec
from chainspec.models.config import ModelConfig, RopeConfig, eos_ids
from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import DecoderParts, Family, MTPBlock
from chainspec.models.head_gated_attention import HeadGatedAttention
from chainspec.models.layers import AttentionBackend, RMSNorm
from chainspec.models.moe import MoEConfig, RouterConfig, Scoring, SparseMoE
from chainspec.models.rope import RotaryEmbedding
from chainspec.models.sliding_attention import AttentionShape

FULL, SLIDING = "full_attention", "sliding_attention"
DENSE, SPARSE = "dense", "sparse"
ARCH = "Step3p5ForCausalLM"


@dataclass(frozen=True)
class Step3Config(ModelConfig):
    sliding_window: int = 512
    sliding_heads: int = 0
    query_scale: float = 128.0  # query_pre_attn_scalar
    head_gate: bool = True
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    mtp_layer_types: tuple[str, ...] = ()
    mtp_mlp_layer_types: tuple[str, ...] = ()
    swiglu_limits: tuple[float | None, ...] = ()  # dense MLPs: target, then MTP layers
    expert_limits: tuple[float | None, ...] = ()  # routed experts (`swiglu_limits`)
    moe: MoEConfig | None = None  # the sparse layers' block (None: every layer dense)
    sliding_rope: RopeConfig = field(default_factory=RopeConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_layers
        # NOTE: the MTP lists are not held to num_mtp_layers: train-mtp re-counts modules
        for name, kinds, count, known in (
                ("layer_types", self.layer_types, n, {FULL, SLIDING}),
                ("mlp_layer_types", self.mlp_layer_types, n, {DENSE, SPARSE}),
                ("mtp_layer_types", self.mtp_layer_types, None, {FULL, SLIDING}),
                ("mtp_mlp_layer_types", self.mtp_mlp_layer_types, None, {DENSE, SPARSE})):
            if count is not None and len(kinds) != count:
                raise CheckpointError(f"{name} has {len(kinds)} entries for {count} layers")
            if set(kinds) - known:
                raise CheckpointError(f"unsupported {name} {sorted(set(kinds) - known)}")
        if len(self.swiglu_limits) < n:
            raise CheckpointError(f"swiglu_limits_shared has {len(self.swiglu_limits)} "
                                  f"entries for {n} layers")
        moe = [i for i, kind in enumerate(self.mlp_layer_types) if kind == SPARSE]
        if moe and self.moe is None:
            raise CheckpointError(f"{ARCH}: MoE layers {_spans(moe)} (mlp_layer_types "
                                  f"'sparse') without moe_num_experts")
        if self.sliding_heads % self.num_kv_heads:
            raise CheckpointError(f"num_sliding_attention_heads {self.sliding_heads} is not "
                                  f"a multiple of num_key_value_heads {self.num_kv_heads}")

    def shape(self, kind: str) -> AttentionShape:
        sliding = kind == SLIDING
        return AttentionShape(
            self.hidden_size, self.sliding_heads if sliding else self.num_heads,
            self.num_kv_heads, self.head_dim, self.head_dim,
            self.sliding_window if sliding else None, bias=self.qkv_bias)

    def rope_of(self, kind: str) -> RopeConfig:
        return self.sliding_rope if kind == SLIDING else self.rope

    def moe_of(self, index: int) -> MoEConfig | None:
        """Layer `index`'s MoE block (its own expert clamp); None for a dense layer."""
        if self.moe is None or self.mlp_layer_types[index] != SPARSE:
            return None
        limit = self.expert_limits[index] if index < len(self.expert_limits) else None
        return replace(self.moe, expert_limit=limit)

    def limit(self, index: int) -> float | None:
        """The dense MLP clamp of layer `index` (MTP layers follow the target's)."""
        return self.swiglu_limits[index] if index < len(self.swiglu_limits) else None

    @property
    def mtp_kind(self) -> str:
        """The MTP layers' attention kind (transformers' default: full)."""
        return self.mtp_layer_types[0] if self.mtp_layer_types else FULL

    def check_mtp(self) -> None:
        """The MTP layers chainspec builds: dense, all of one attention kind."""
        if SPARSE in self.mtp_mlp_layer_types:
            raise CheckpointError(f"{ARCH}: MoE MTP layers (mtp_mlp_layer_types 'sparse') "
                                  f"are not supported; dense only")
        n, m = self.num_layers, max(self.num_mtp_layers, 1)
        if len(set(self.mtp_layer_types)) > 1 or len({self.limit(n + i) for i in range(m)}) > 1:
            raise CheckpointError(f"{ARCH}: MTP layers of different kinds or swiglu limits "
                                  f"({list(self.mtp_layer_types)}) are not supported")


def _spans(indices: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    spans, start = [], indices[0]
    for prev, cur in zip(indices, [*indices[1:], None], strict=True):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


def _split(cfg: dict[str, Any], key: str, n: int, m: int) -> tuple[list | None, list | None]:
    """A per-layer list, and its MTP entries where the hub padded it with them."""
    value = cfg.get(key)
    if isinstance(value, list) and len(value) > n:
        return value[:n], value[n:n + m]
    return value, None


def _mlp_types(cfg: dict[str, Any], n: int, m: int) -> tuple[list[str], list[str]]:
    target, mtp = _split(cfg, "mlp_layer_types", n, m)
    if target is None:  # the hub's `moe_layers_enum`, over target and MTP layers
        enum = cfg.get("moe_layers_enum")
        if enum is None:
            moe = set(range(3, n))  # transformers' default
        else:
            items = enum.split(",") if isinstance(enum, str) else enum
            try:
                moe = {int(i) for i in items if str(i).strip()}
            except ValueError:
                raise CheckpointError(f"unsupported moe_layers_enum {enum!r}: layer "
                                      f"indices expected") from None
        kinds = [SPARSE if i in moe else DENSE for i in range(n + m)]
        target, mtp = kinds[:n], kinds[n:]
    return target, cfg.get("mtp_mlp_layer_types") or mtp or [DENSE] * m


def _ropes(cfg: dict[str, Any], kinds: list[str]) -> dict[str, RopeConfig]:
    """One RopeConfig per attention kind: transformers' `rope_parameters` per kind, or the
    hub's per-layer `rope_theta` / `partial_rotary_factors` (a layer of each kind)."""
    params = cfg.get("rope_parameters") or {}
    thetas, factors = cfg.get("rope_theta", 10000.0), cfg.get("partial_rotary_factors")
    ropes = {}
    for kind in (FULL, SLIDING):
        p = params.get(kind) if isinstance(params.get(kind), dict) else None
        if p is None:
            i = kinds.index(kind) if kind in kinds else 0
            p = {"rope_theta": thetas[i] if isinstance(thetas, list) else thetas,
                 "partial_rotary_factor": factors[i] if factors else 1.0}
            if kind == FULL and cfg.get("rope_scaling"):
                p = {**cfg["rope_scaling"], **p}
        ropes[kind] = RopeConfig(
            theta=float(p.get("rope_theta", 10000.0)),
            type=p.get("rope_type", p.get("type", "default")),
            factor=float(p.get("factor", 1.0)),
            original_max_position=p.get("original_max_position_embeddings"),
            beta_fast=float(p.get("beta_fast", 32.0)), beta_slow=float(p.get("beta_slow", 1.0)),
            attention_factor=p.get("attention_factor"),
            partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)))
    return ropes


def _moe(cfg: dict[str, Any], hidden: int) -> MoEConfig | None:
    """The sparse layers' block (module docstring); None without routed experts."""
    experts = cfg.get("moe_num_experts") or cfg.get("n_routed_experts")
    if not experts:
        return None
    activation = cfg.get("moe_router_activation", "sigmoid")
    if activation != "sigmoid":
        raise CheckpointError(f"unsupported router moe_router_activation={activation!r} "
                              f"(Step-3.5 routes with 'sigmoid')")
    if cfg.get("use_moe_router_bias") is False:
        raise CheckpointError("unsupported router use_moe_router_bias=false (the correction "
                              "bias moe.router_bias is required)")
    top_k = cfg.get("moe_top_k") or cfg["num_experts_per_tok"]
    router = RouterConfig(int(experts), int(top_k), Scoring.SIGMOID, norm_topk_prob=True,
                          norm_eps=0.0)
    return MoEConfig(router, hidden, int(cfg["moe_intermediate_size"]),
                     int(cfg.get("share_expert_dim") or cfg["moe_intermediate_size"]),
                     output_scale=float(cfg.get("moe_router_scaling_factor") or 1.0))


def _limits(values: list | None, count: int) -> tuple[float | None, ...]:
    return tuple(float(x) if x else None for x in (values or [None] * count))


def parse(cfg: dict[str, Any], arch: str) -> Step3Config:
    n = int(cfg["num_hidden_layers"])
    m = STEP3.num_modules(cfg)
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(f"{arch}: use_bidirectional_attention is not supported")
    if not all(cfg.get("use_rope_layers") or [True]):
        raise CheckpointError(f"{arch}: layers without RoPE (use_rope_layers) are not "
                              f"supported")
    kinds, mtp_kinds = _split(cfg, "layer_types", n, m)
    kinds = kinds or [FULL] * n
    mlp_kinds, mtp_mlp_kinds = _mlp_types(cfg, n, m)
    other = cfg.get("attention_other_setting") or {}
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_groups"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    limits, mtp_limits = _split(cfg, "swiglu_limits_shared", n, m)
    expert_limits = _split(cfg, "swiglu_limits", n, m)[0]
    ropes = _ropes(cfg, kinds)
    return Step3Config(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        max_position=int(cfg.get("max_position_embeddings", 262144)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=True,
        rope=ropes[FULL],
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        num_mtp_layers=m,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        sliding_window=int(cfg.get("sliding_window") or 512),
        sliding_heads=int(cfg.get("num_sliding_attention_heads")
                          or other.get("num_attention_heads") or heads),
        query_scale=float(cfg.get("query_pre_attn_scalar") or head_dim),
        head_gate=bool(cfg.get("use_head_wise_attn_gate", True)),
        layer_types=tuple(kinds),
        mlp_layer_types=tuple(mlp_kinds),
        mtp_layer_types=tuple(cfg.get("mtp_layer_types") or mtp_kinds or [FULL] * m),
        mtp_mlp_layer_types=tuple(mtp_mlp_kinds),
        swiglu_limits=_limits(limits, n) + _limits(mtp_limits, m),
        expert_limits=_limits(expert_limits, n),
        moe=_moe(cfg, int(cfg["hidden_size"])),
        sliding_rope=ropes[SLIDING],
    )


class ClampedMLP(nn.Module):
    """SwiGLU with the family's clamp: silu(gate) <= limit, |up| <= limit (none: plain)."""

    def __init__(self, cfg: Step3Config, limit: float | None, width: int | None = None
                 ) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, width or cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.silu(self.gate_proj(x)), self.up_proj(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    """Pre-norm head-gated attention (`full` or `sliding` shape) + dense clamped SwiGLU or
    the MoE block (`moe`)."""

    def __init__(self, cfg: Step3Config, layer_id: int, kind: str, rotary: RotaryEmbedding,
                 limit: float | None, moe: MoEConfig | None = None) -> None:
        super().__init__()
        self.self_attn = HeadGatedAttention(cfg.shape(kind), layer_id, rotary, eps=cfg.rms_eps,
                                            scale=cfg.query_scale ** -0.5,
                                            head_gate=cfg.head_gate)
        self.mlp = ClampedMLP(cfg, limit) if moe is None else SparseMoE(
            moe, shared=ClampedMLP(cfg, limit, moe.shared_intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, unit_offset=True)

    def cache_spec(self) -> CacheSpec:
        return self.self_attn.cache_spec()

    def forward(self, x, positions, backend: AttentionBackend):
        x = x + self.self_attn(self.input_layernorm(x), positions, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


def _rotary(cfg: Step3Config, kind: str, cache_len: int | None) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.rope_of(kind), cfg.head_dim, cfg.max_position, cache_len)


def build(cfg: Step3Config, cache_len: int | None) -> DecoderParts:
    rotary = {kind: _rotary(cfg, kind, cache_len) for kind in sorted(set(cfg.layer_types))}
    layers = [DecoderLayer(cfg, i, kind, rotary[kind], cfg.limit(i), cfg.moe_of(i))
              for i, kind in enumerate(cfg.layer_types)]
    norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, unit_offset=True)
    return DecoderParts(layers, list(rotary.values()), norm)


def mtp_block(cfg: Step3Config, cache_len: int | None) -> MTPBlock:
    cfg.check_mtp()
    rotary = _rotary(cfg, cfg.mtp_kind, cache_len)
    block = DecoderLayer(cfg, 0, cfg.mtp_kind, rotary, cfg.limit(cfg.num_layers))
    return MTPBlock(block, [rotary])


HUB_MOE = ((re.compile(r"\.mlp\.gate\.weight$"), ".moe.gate.weight"),
           (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".moe.router_bias"),
           (re.compile(r"\.mlp\.experts\.gate_up_proj$"), ".moe.gate_up_proj"),  # halves
           (re.compile(r"\.mlp\.experts\.down_proj$"), ".moe.down_proj.weight"),
           (re.compile(r"\.mlp\.shared_experts\."), ".share_expert."))


def checkpoint_name(key: str) -> str:
    """The hub's name of a state key (the MoE table above; every other name is HF's)."""
    for pattern, hub in HUB_MOE:
        if pattern.search(key):
            return pattern.sub(hub, key)
    return key


STEP3P5 = Family(
    name="step3",
    architectures=(ARCH,),
    parse=parse, build=build, checkpoint_name=checkpoint_name, mtp=STEP3,
    mtp_block=mtp_block, hidden_before_norm=True,
    notes="head-gated full : sliding attention (no sinks), zero-centred norms, dense or MoE "
          "MLPs (sigmoid router, clamped experts, one shared expert); 3 chained MTP layers "
          "at model.layers.{N+i}, each its own head, h before the final norm",
)
FAMILIES = (STEP3P5,)

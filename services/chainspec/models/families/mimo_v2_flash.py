"""The MiMo-V2-Flash family (`MiMoV2FlashForCausalLM`, transformers' `mimo_v2_flash`).

Layer pattern: `layer_types` (default: layer 0 and every 6th `full_attention`, the rest
`sliding_attention`, 5:1). Both kinds are `models/sliding_attention.py` with their own
shape, as transformers builds them:
- `full`: `num_attention_heads` heads over `num_key_value_heads` kv heads, no window, no
  sinks, RoPE `rope_parameters["full_attention"]`;
- `sliding`: the same query heads over twice the kv heads, window `sliding_window`
  (a row sees that many keys, itself included), a sink logit per head
  (`self_attn.attention_sink_bias`), RoPE `rope_parameters["sliding_attention"]`;
- both: keys `head_dim` wide, values `v_head_dim`, values scaled by
  `attention_value_scale`, partial RoPE (`partial_rotary_factor`, 0.334).
MLP kinds by `mlp_layer_types`: `dense` (SwiGLU); `sparse` (`models/moe.py`'s SparseMoE,
as transformers' `MiMoV2FlashMoE`: DeepSeek-V3's sigmoid router -- correction bias
`gate.e_score_correction_bias`, group-limited top-k `n_group`/`topk_group`, weights
normalised by their sum + 1e-20 with `norm_topk_prob`, times `routed_scaling_factor`
(the hub's null: 1.0) -- and **no shared experts**: a config's `n_shared_experts` is ignored,
as transformers ignores it; the router weight stays fp32 on a bf16 load, as transformers
keeps it). Experts load per expert (`mlp.experts.{e}.*_proj`, the hub's
and `save_pretrained`'s layout) or fused.
Configs parse in transformers' layout (what `save_pretrained` writes) and in the hub's
original one (what SGLang's `mimo_v2_flash.py` and vLLM's read), field for field:

| transformers | hub |
|---|---|
| `layer_types` | `hybrid_layer_pattern` (0 full, 1 sliding) |
| `mlp_layer_types` | `moe_layer_freq` (0 dense, 1 MoE) |
| sliding kv heads: 2 x `num_key_value_heads` | `swa_num_key_value_heads` |
| `sliding_window` (keys a row sees, itself included) | `sliding_window_size` + 1 (keys |
| | before the row: SGLang's window; transformers adds the 1 too) |
| `rope_parameters[kind]` | `rope_theta`, `swa_rope_theta`, `partial_rotary_factor` |
| `rms_norm_eps` | `layernorm_epsilon` |
| sinks on sliding layers only | `add_swa_attention_sink_bias`, `add_full_attention_sink_bias` |
Refused by name: `swa_num_attention_heads` / `swa_head_dim` / `swa_v_head_dim` other than
the full layers' (no release differs), `attention_projection_layout` "fused_qkv" (a fused
`qkv_proj` tensor), pattern values other than 0/1, an integer `moe_layer_freq`.
Checkpoint tensors are the hub's names (transformers saves those: `attention_sink_bias`,
not `sinks`).

MTP glue (the hub's `model.mtp.layers.{i}.*`; SGLang `mimo_v2_flash_nextn.py` with its
multi-layer EAGLE worker, vLLM `mimo_v2_mtp.py`):

| | |
|---|---|
| tensors | `enorm`, `hnorm`, `eh_proj`, `input_layernorm`, `self_attn.{q,k,v,o}_proj`, |
| | `self_attn.attention_sink_bias`, `pre_mlp_layernorm`, `mlp.*`, `final_layernorm` |
| | per layer; embedding and head shared with the target |
| count | `num_nextn_predict_layers` (3 released); step k uses layer (k-1) mod L |
| concat | [enorm(emb), hnorm(hidden)] (unlike MiMo-7B's [hidden, emb]) |
| hidden read | h *before* the target's final norm (SGLang sets |
| | `return_hidden_states_before_norm`); so this family exports that h and applies the |
| | norm in `TargetModel.logits` |
| token offset | step k at row p reads x[p+k] (SGLang rotates the input ids once per step) |
| chain | **no**: every step reads the target's h (SGLang's chain list holds Step3.5 and |
| | Inkling only); `MTPGlue.chains` False, so no `--no-chain` needed |
| layer kind | one `sliding` layer (SWA heads/kv heads, window, sinks) + dense SwiGLU; no |
| | value scale (SGLang's MTP layer passes none; vLLM's passes |
| | `attention_value_scale`: `MTP_VALUE_SCALE` below is the one switch) |

Where the engines differ: vLLM reads h after the norm and runs layer 0 for every step
(`_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1`); SGLang (Xiaomi's day-0 code) is followed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from chainspec.models.adapters import MIMO_V2
from chainspec.models.cache_spec import CacheSpec
from chainspec.models.config import ModelConfig, RopeConfig, eos_ids
from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import DecoderParts, Family, MTPBlock
from chainspec.models.layers import MLP, AttentionBackend, RMSNorm
from chainspec.models.moe import MoEConfig, Scoring, SparseMoE, num_experts
from chainspec.models.rope import RotaryEmbedding
from chainspec.models.sliding_attention import AttentionShape, SlidingAttention

FULL, SLIDING = "full_attention", "sliding_attention"
DENSE, SPARSE = "dense", "sparse"
MTP_VALUE_SCALE = False  # the MTP layer scales values by attention_value_scale


@dataclass(frozen=True)
class MiMoV2FlashConfig(ModelConfig):
    v_head_dim: int = 128
    sliding_window: int = 129
    value_scale: float = 1.0
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    sliding_rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_kv_heads: int | None = None  # None: twice num_kv_heads (transformers' layout)
    sliding_sinks: bool = True
    full_sinks: bool = False
    moe: MoEConfig | None = None  # the sparse layers' block (None: every layer dense)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads % self.swa_kv_heads:
            raise CheckpointError(f"num_attention_heads {self.num_heads} is not a multiple "
                                  f"of swa_num_key_value_heads {self.swa_kv_heads}")
        for name, kinds, known in (("layer_types", self.layer_types, {FULL, SLIDING}),
                                   ("mlp_layer_types", self.mlp_layer_types, {DENSE, SPARSE})):
            if len(kinds) != self.num_layers:
                raise CheckpointError(f"{name} has {len(kinds)} entries for "
                                      f"{self.num_layers} layers")
            if set(kinds) - known:
                raise CheckpointError(f"unsupported {name} {sorted(set(kinds) - known)}")
        if (SPARSE in self.mlp_layer_types) != (self.moe is not None):
            raise CheckpointError("mlp_layer_types 'sparse' (moe_layer_freq 1) needs "
                                  "routed experts (n_routed_experts), and only it has them")

    @property
    def swa_kv_heads(self) -> int:
        return self.sliding_kv_heads or 2 * self.num_kv_heads

    def shape(self, kind: str, value_scale: bool = True) -> AttentionShape:
        sliding = kind == SLIDING
        return AttentionShape(
            self.hidden_size, self.num_heads,
            self.swa_kv_heads if sliding else self.num_kv_heads,
            self.head_dim, self.v_head_dim, self.sliding_window if sliding else None,
            sinks=self.sliding_sinks if sliding else self.full_sinks,
            value_scale=self.value_scale if value_scale else 1.0, bias=self.qkv_bias)

    def rope_of(self, kind: str) -> RopeConfig:
        return self.sliding_rope if kind == SLIDING else self.rope


def _default_layer_types(n: int) -> list[str]:
    return [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(n)]


HUB_ATTENTION = {0: FULL, 1: SLIDING}  # `hybrid_layer_pattern` values
HUB_MLP = {0: DENSE, 1: SPARSE}  # `moe_layer_freq` values
HUB_SAME_AS_FULL = {"swa_num_attention_heads": "num_attention_heads",
                    "swa_head_dim": "head_dim", "swa_v_head_dim": "v_head_dim"}


def _rope(cfg: dict[str, Any], kind: str, default_theta: float) -> RopeConfig:
    """transformers' `rope_parameters[kind]`, else the hub's `rope_theta` (full) or
    `swa_rope_theta` (sliding) with `partial_rotary_factor` and `rope_scaling`."""
    params = (cfg.get("rope_parameters") or {}).get(kind)
    if params is None:
        theta_key = "swa_rope_theta" if kind == SLIDING else "rope_theta"
        scaling = cfg.get("rope_scaling") or {}
        params = {"rope_theta": cfg.get(theta_key, default_theta),
                  "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
                  "factor": scaling.get("factor", 1.0),
                  "partial_rotary_factor": cfg.get("partial_rotary_factor", 0.334)}
    return RopeConfig(theta=float(params.get("rope_theta", default_theta)),
                      type=params.get("rope_type", "default"),
                      factor=float(params.get("factor", 1.0)),
                      partial_rotary_factor=float(params.get("partial_rotary_factor", 0.334)))


def _kinds(cfg: dict[str, Any], name: str, hub: str, table: dict[int, str],
           default: list[str]) -> tuple[str, ...]:
    """A per-layer pattern: transformers' `name` (kind names), else the hub's `hub`
    (integer codes, `table`), else `default`."""
    if cfg.get(name):
        return tuple(cfg[name])
    codes = cfg.get(hub)
    if codes is None:
        return tuple(default)
    if not isinstance(codes, list):
        raise CheckpointError(f"unsupported {hub} {codes!r}: one entry per layer expected")
    unknown = sorted({repr(c) for c in codes if c not in table})
    if unknown:
        raise CheckpointError(f"unsupported {hub} values {', '.join(unknown)} (known: "
                              f"{', '.join(f'{c} {k}' for c, k in table.items())})")
    return tuple(table[c] for c in codes)


def _window(cfg: dict[str, Any]) -> int:
    """Keys a sliding row sees, itself included: the hub's `sliding_window_size` counts
    those before it (transformers' config adds 1 to it as well)."""
    if cfg.get("sliding_window_size") is not None:
        return int(cfg["sliding_window_size"]) + 1
    return int(cfg.get("sliding_window") or 129)


def _check_hub_fields(cfg: dict[str, Any]) -> None:
    for swa, full in HUB_SAME_AS_FULL.items():
        if cfg.get(swa) is not None and cfg.get(full) is not None and cfg[swa] != cfg[full]:
            raise CheckpointError(f"{swa} {cfg[swa]} differs from {full} {cfg[full]}: "
                                  f"not supported")
    if cfg.get("attention_projection_layout") == "fused_qkv":
        raise CheckpointError("attention_projection_layout 'fused_qkv' (one qkv_proj "
                              "tensor) is not supported; q/k/v_proj only")


def _moe(cfg: dict[str, Any], mlp_kinds: tuple[str, ...]) -> MoEConfig | None:
    """The sparse layers' block (module docstring); None without sparse layers."""
    if SPARSE not in mlp_kinds:
        return None
    if not num_experts(cfg):
        raise CheckpointError("mlp_layer_types 'sparse' without n_routed_experts")
    moe = MoEConfig.from_hf(cfg, Scoring.SIGMOID, norm_default=True)
    return replace(moe, router=replace(moe.router, fp32_weight=True),  # transformers': strict
                   shared_intermediate_size=0, shared_gate=False)


def parse(cfg: dict[str, Any], arch: str) -> MiMoV2FlashConfig:
    n = int(cfg["num_hidden_layers"])
    scale = cfg.get("attention_value_scale", 0.707)
    _check_hub_fields(cfg)
    kv = int(cfg["num_key_value_heads"])
    mlp_kinds = _kinds(cfg, "mlp_layer_types", "moe_layer_freq", HUB_MLP,
                       [DENSE] + [SPARSE] * (n - 1))
    return MiMoV2FlashConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=kv,
        head_dim=int(cfg.get("head_dim") or 192),
        max_position=int(cfg.get("max_position_embeddings", 131072)),
        rms_eps=float(cfg.get("rms_norm_eps", cfg.get("layernorm_epsilon", 1e-5))),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        rope=_rope(cfg, FULL, 5_000_000.0),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        num_mtp_layers=MIMO_V2.num_modules(cfg),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        v_head_dim=int(cfg.get("v_head_dim") or 128),
        sliding_window=_window(cfg),
        value_scale=1.0 if scale is None else float(scale),
        layer_types=_kinds(cfg, "layer_types", "hybrid_layer_pattern", HUB_ATTENTION,
                           _default_layer_types(n)),
        mlp_layer_types=mlp_kinds,
        sliding_rope=_rope(cfg, SLIDING, 10_000.0),
        sliding_kv_heads=int(cfg.get("swa_num_key_value_heads") or 2 * kv),
        sliding_sinks=bool(cfg.get("add_swa_attention_sink_bias", True)),
        full_sinks=bool(cfg.get("add_full_attention_sink_bias", False)),
        moe=_moe(cfg, mlp_kinds),
    )


class DecoderLayer(nn.Module):
    """Pre-norm attention (`full` or `sliding` shape) + dense SwiGLU or MoE MLP."""

    post_norm = "post_attention_layernorm"  # the checkpoint's name of the MLP's norm

    def __init__(self, cfg: MiMoV2FlashConfig, layer_id: int, shape: AttentionShape,
                 rotary: RotaryEmbedding, sparse: bool = False) -> None:
        super().__init__()
        self.self_attn = SlidingAttention(shape, layer_id, rotary)
        self.mlp = SparseMoE(cfg.moe) if sparse and cfg.moe else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        setattr(self, self.post_norm, RMSNorm(cfg.hidden_size, cfg.rms_eps))

    def cache_spec(self) -> CacheSpec:
        return self.self_attn.cache_spec()

    def forward(self, x, positions, backend: AttentionBackend):
        x = x + self.self_attn(self.input_layernorm(x), positions, backend)
        return x + self.mlp(getattr(self, self.post_norm)(x))


class MTPLayer(DecoderLayer):
    """The MTP layers' block: the same, dense, its MLP norm named `pre_mlp_layernorm`."""

    post_norm = "pre_mlp_layernorm"


def _rotaries(cfg: MiMoV2FlashConfig, cache_len: int | None) -> dict[str, RotaryEmbedding]:
    return {kind: RotaryEmbedding(cfg.rope_of(kind), cfg.head_dim, cfg.max_position,
                                  cache_len) for kind in sorted(set(cfg.layer_types))}


def build(cfg: MiMoV2FlashConfig, cache_len: int | None) -> DecoderParts:
    rotary = _rotaries(cfg, cache_len)
    layers = [DecoderLayer(cfg, i, cfg.shape(kind), rotary[kind], mlp == SPARSE)
              for i, (kind, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types,
                                                  strict=True))]
    return DecoderParts(layers, list(rotary.values()), RMSNorm(cfg.hidden_size, cfg.rms_eps))


def mtp_block(cfg: MiMoV2FlashConfig, cache_len: int | None) -> MTPBlock:
    rotary = RotaryEmbedding(cfg.sliding_rope, cfg.head_dim, cfg.max_position, cache_len)
    return MTPBlock(MTPLayer(cfg, 0, cfg.shape(SLIDING, MTP_VALUE_SCALE), rotary), [rotary])


MIMO_V2_FLASH = Family(
    name="mimo_v2_flash",
    architectures=("MiMoV2FlashForCausalLM",),
    parse=parse, build=build, mtp=MIMO_V2, mtp_block=mtp_block, hidden_before_norm=True,
    notes="sliding window + sinks : full GQA 5:1, values narrower than keys, dense or MoE "
          "MLPs (sigmoid group-limited router, no shared experts); 3 dense MTP layers at "
          "model.mtp.layers.{i}, non-chain, h before the final norm",
)
FAMILIES = (MIMO_V2_FLASH,)

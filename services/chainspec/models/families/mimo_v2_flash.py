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
MLP kinds by `mlp_layer_types`: `dense` (SwiGLU); `sparse` (MoE) is refused for now.
Configs are transformers' layout (what `save_pretrained` writes); checkpoint tensors are
the hub's names (transformers saves those: `attention_sink_bias`, not `sinks`).

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
| | Inkling only); serve it with `--no-chain` |
| layer kind | one `sliding` layer (SWA heads/kv heads, window, sinks) + dense SwiGLU; no |
| | value scale (SGLang's MTP layer passes none; vLLM's passes |
| | `attention_value_scale`: `MTP_VALUE_SCALE` below is the one switch) |

Where the engines differ: vLLM reads h after the norm and runs layer 0 for every step
(`_MIMO_V2_FLASH_NUM_MTP_LAYERS = 1`); SGLang (Xiaomi's day-0 code) is followed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from chainspec.models.adapters import MIMO_V2
from chainspec.models.cache_spec import CacheSpec
from chainspec.models.config import ModelConfig, RopeConfig, eos_ids
from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import DecoderParts, Family, MTPBlock
from chainspec.models.layers import MLP, AttentionBackend, RMSNorm
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

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, kinds, known in (("layer_types", self.layer_types, {FULL, SLIDING}),
                                   ("mlp_layer_types", self.mlp_layer_types, {DENSE, SPARSE})):
            if len(kinds) != self.num_layers:
                raise CheckpointError(f"{name} has {len(kinds)} entries for "
                                      f"{self.num_layers} layers")
            if set(kinds) - known:
                raise CheckpointError(f"unsupported {name} {sorted(set(kinds) - known)}")
        if SPARSE in self.mlp_layer_types:
            raise CheckpointError("MiMoV2FlashForCausalLM: MoE layers (mlp_layer_types "
                                  "'sparse') are not supported yet; dense layers only")

    def shape(self, kind: str, value_scale: bool = True) -> AttentionShape:
        sliding = kind == SLIDING
        return AttentionShape(
            self.hidden_size, self.num_heads, self.num_kv_heads * (2 if sliding else 1),
            self.head_dim, self.v_head_dim, self.sliding_window if sliding else None,
            sinks=sliding, value_scale=self.value_scale if value_scale else 1.0,
            bias=self.qkv_bias)

    def rope_of(self, kind: str) -> RopeConfig:
        return self.sliding_rope if kind == SLIDING else self.rope


def _default_layer_types(n: int) -> list[str]:
    return [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(n)]


def _rope(cfg: dict[str, Any], kind: str, default_theta: float) -> RopeConfig:
    params = (cfg.get("rope_parameters") or {}).get(kind) or {}
    return RopeConfig(theta=float(params.get("rope_theta", default_theta)),
                      type=params.get("rope_type", "default"),
                      factor=float(params.get("factor", 1.0)),
                      partial_rotary_factor=float(params.get("partial_rotary_factor", 0.334)))


def parse(cfg: dict[str, Any], arch: str) -> MiMoV2FlashConfig:
    n = int(cfg["num_hidden_layers"])
    scale = cfg.get("attention_value_scale", 0.707)
    return MiMoV2FlashConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg.get("head_dim") or 192),
        max_position=int(cfg.get("max_position_embeddings", 131072)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        rope=_rope(cfg, FULL, 5_000_000.0),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        num_mtp_layers=MIMO_V2.num_modules(cfg),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        v_head_dim=int(cfg.get("v_head_dim") or 128),
        sliding_window=int(cfg.get("sliding_window") or 129),
        value_scale=1.0 if scale is None else float(scale),
        layer_types=tuple(cfg.get("layer_types") or _default_layer_types(n)),
        mlp_layer_types=tuple(cfg.get("mlp_layer_types") or [DENSE] + [SPARSE] * (n - 1)),
        sliding_rope=_rope(cfg, SLIDING, 10_000.0),
    )


class DecoderLayer(nn.Module):
    """Pre-norm attention (`full` or `sliding` shape) + dense SwiGLU MLP."""

    post_norm = "post_attention_layernorm"  # the checkpoint's name of the MLP's norm

    def __init__(self, cfg: MiMoV2FlashConfig, layer_id: int, shape: AttentionShape,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = SlidingAttention(shape, layer_id, rotary)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        setattr(self, self.post_norm, RMSNorm(cfg.hidden_size, cfg.rms_eps))

    def cache_spec(self) -> CacheSpec:
        return self.self_attn.cache_spec()

    def forward(self, x, positions, backend: AttentionBackend):
        x = x + self.self_attn(self.input_layernorm(x), positions, backend)
        return x + self.mlp(getattr(self, self.post_norm)(x))


class MTPLayer(DecoderLayer):
    """The MTP layers' block: the same, its MLP norm named `pre_mlp_layernorm`."""

    post_norm = "pre_mlp_layernorm"


def _rotaries(cfg: MiMoV2FlashConfig, cache_len: int | None) -> dict[str, RotaryEmbedding]:
    return {kind: RotaryEmbedding(cfg.rope_of(kind), cfg.head_dim, cfg.max_position,
                                  cache_len) for kind in sorted(set(cfg.layer_types))}


def build(cfg: MiMoV2FlashConfig, cache_len: int | None) -> DecoderParts:
    rotary = _rotaries(cfg, cache_len)
    layers = [DecoderLayer(cfg, i, cfg.shape(kind), rotary[kind])
              for i, kind in enumerate(cfg.layer_types)]
    return DecoderParts(layers, list(rotary.values()), RMSNorm(cfg.hidden_size, cfg.rms_eps))


def mtp_block(cfg: MiMoV2FlashConfig, cache_len: int | None) -> MTPBlock:
    rotary = RotaryEmbedding(cfg.sliding_rope, cfg.head_dim, cfg.max_position, cache_len)
    return MTPBlock(MTPLayer(cfg, 0, cfg.shape(SLIDING, MTP_VALUE_SCALE), rotary), [rotary])


MIMO_V2_FLASH = Family(
    name="mimo_v2_flash",
    architectures=("MiMoV2FlashForCausalLM",),
    parse=parse, build=build, mtp=MIMO_V2, mtp_block=mtp_block, hidden_before_norm=True,
    notes="sliding window + sinks : full GQA 5:1, values narrower than keys, dense MLPs "
          "(MoE not yet); 3 MTP layers at model.mtp.layers.{i}, non-chain, h before "
          "the final norm",
)
FAMILIES = (MIMO_V2_FLASH,)

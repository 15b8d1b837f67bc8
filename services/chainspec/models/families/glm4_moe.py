"""The GLM-4.5 / 4.6 family (`Glm4MoeForCausalLM`): GQA + MoE, with a NextN MTP layer.

Layer kinds: `full` attention (layers.Attention: GQA, q/k/v bias from `attention_bias`,
no o_proj bias, q/k RMSNorm when `use_qk_norm`, partial RoPE over the first
`partial_rotary_factor` (default 0.5) of each head, rotate-half pairing); MLP `dense`
(SwiGLU of `intermediate_size`) on the first `first_k_dense_replace` layers, `moe` after
(models/moe.py: sigmoid router with `e_score_correction_bias`, group-limited top-k over
`n_group` / `topk_group`, `norm_topk_prob`, `routed_scaling_factor`; shared experts of
width moe_intermediate_size * n_shared_experts). Tensor names are Hugging Face's, one to
one; experts load per expert or stacked.

MTP glue (vLLM `glm4_moe_mtp.py`, SGLang `glm4_moe_nextn.py`; `adapters.DEEPSEEK`):

| what | GLM-4.5 |
|---|---|
| where | `model.layers.{N+i}.*`, N = num_hidden_layers; `num_nextn_predict_layers` |
| glue | `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`; the layer's `embed_tokens` / |
| | `shared_head.head` copy the shared ones (ignored) |
| concat | [enorm(Emb(x[p+k])), hnorm(g[k-1][p])] |
| chain | yes: step k reads step k-1's block output (before `shared_head.norm`) |
| hidden read | the target's h after the final norm |
| token offset | step k at row p reads x[p+k] and predicts x[p+k+1] |
| layer kind | the family's decoder layer at index N: full attention + MoE (N >= |
| | first_k_dense_replace, as vLLM builds it), dense where the config has no experts |

NOTE: vLLM zeroes the token embedding of the position-0 row before `enorm`; chainspec
does not (it changes one cached MTP row per sequence, never the verified output).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from chainspec.models.adapters import DEEPSEEK
from chainspec.models.config import ModelConfig, RopeConfig, eos_ids
from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import DecoderParts, Family, MTPBlock
from chainspec.models.layers import DecoderLayer, RMSNorm
from chainspec.models.moe import MoEConfig, Scoring, SparseMoE, num_experts, sparse_layers
from chainspec.models.rope import RotaryEmbedding

# transformers' Glm4MoeConfig defaults for the fields a hub config may leave out
MOE_DEFAULTS = {"first_k_dense_replace": 1, "n_shared_experts": 1}


@dataclass(frozen=True)
class MoEStackConfig(ModelConfig):
    """A stack of full-attention layers whose MLPs are dense or MoE by the config's layer
    pattern (GLM-4.5 here, Qwen3-MoE in `qwen3_moe.py`)."""

    moe: MoEConfig | None = None  # None: no routed experts, every layer dense
    sparse: tuple[bool, ...] = ()  # per target layer: MoE MLP
    mtp_sparse: bool = False  # the MTP block's MLP (layer N's kind)


def check_activation(cfg: dict[str, Any], arch: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{arch}: unsupported hidden_act={act!r} (SwiGLU needs 'silu')")


def partial_rope(cfg: dict[str, Any], default: float) -> RopeConfig:
    """RoPE with `partial_rotary_factor` from `rope_parameters` or the top level."""
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))
    return replace(RopeConfig.from_hf(cfg), partial_rotary_factor=float(factor))


def moe_pattern(cfg: dict[str, Any], layers: int, scoring: Scoring, norm_default: bool
                ) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    """The MoE block and, per layer 0..N (N: the MTP layer's index), whether it is MoE."""
    if not num_experts(cfg):
        return None, (False,) * (layers + 1)
    return MoEConfig.from_hf(cfg, scoring, norm_default), sparse_layers(cfg, layers + 1)


def parse(cfg: dict[str, Any], arch: str) -> MoEStackConfig:
    check_activation(cfg, arch)
    layers, heads, hidden = (int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]),
                             int(cfg["hidden_size"]))
    moe, pattern = moe_pattern({**MOE_DEFAULTS, **cfg}, layers, Scoring.SIGMOID, True)
    return MoEStackConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        rope=partial_rope(cfg, 0.5),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        moe=moe,
        sparse=pattern[:layers],
        mtp_sparse=pattern[layers],
    )


def layer(cfg: MoEStackConfig, layer_id: int, rotary: RotaryEmbedding, sparse: bool
          ) -> DecoderLayer:
    """Full attention + the MLP kind (the MoE block, or dense SwiGLU)."""
    return DecoderLayer(cfg, layer_id, rotary, SparseMoE(cfg.moe) if sparse else None)


def _rotary(cfg: ModelConfig, cache_len: int | None) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position, cache_len)


def build(cfg: MoEStackConfig, cache_len: int | None) -> DecoderParts:
    rotary = _rotary(cfg, cache_len)
    layers = [layer(cfg, i, rotary, s) for i, s in enumerate(cfg.sparse)]
    return DecoderParts(layers, [rotary], RMSNorm(cfg.hidden_size, cfg.rms_eps))


def mtp_block(cfg: MoEStackConfig, cache_len: int | None) -> MTPBlock:
    """The NextN layer's block: `model.layers.{N+i}.self_attn.*`, `.mlp.*` (MoE: gate,
    experts, shared_experts), `.input_layernorm`, `.post_attention_layernorm`."""
    rotary = _rotary(cfg, cache_len)
    return MTPBlock(layer(cfg, 0, rotary, cfg.mtp_sparse), [rotary])


GLM4_MOE = Family(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    parse=parse, build=build, mtp=DEEPSEEK, mtp_block=mtp_block,
    notes="full GQA (partial RoPE, optional q/k norm, qkv bias) + dense then MoE (sigmoid, "
          "group-limited, shared experts); NextN MTP at model.layers.{N+i} (MoE block), "
          "chained, reads h after the final norm",
)
FAMILIES = (GLM4_MOE,)

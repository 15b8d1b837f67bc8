"""The DeepSeek-V3 family (`DeepseekV3ForCausalLM`): MLA attention + SwiGLU or MoE MLPs.

Layer kinds: `mla` (models/mla.py: q/kv low rank, rope/nope split, interleaved RoPE, a
latent paged cache of c_kv + k_rope) and per layer a `dense` SwiGLU MLP (layers below
`first_k_dense_replace`) or the `moe` kind (models/moe.py: sigmoid router with
`e_score_correction_bias`, `n_group`/`topk_group` group-limited top-k,
`routed_scaling_factor`, `n_shared_experts` shared experts). Tensor names are Hugging
Face's, one to one (experts per expert or stacked, models/moe.py).

MTP glue (DeepSeek-V3 section 2.2; `adapters.DEEPSEEK`):

| what | DeepSeek-V3 |
|---|---|
| where | `model.layers.{N+i}.*`, N = num_hidden_layers; `num_nextn_predict_layers` |
| glue | `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (the final norm); the layer's |
| | `embed_tokens` / `shared_head.head` copy the shared ones (ignored) |
| concat | [enorm(Emb(x[p+k])), hnorm(g[k-1][p])] |
| chain | yes: step k reads step k-1's block output (before `shared_head.norm`); |
| | one released layer serves every step (step k runs module (k-1) mod L) |
| hidden read | the target's h after the final norm (what its LM head reads) |
| token offset | step k at row p reads x[p+k] and predicts x[p+k+1] |
| layer kind | MLA + the MLP kind of the last target layer (released: MoE, experts |
| | at `model.layers.{N}.mlp.experts.*`; an all-dense tiny target: dense) |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from chainspec.models.adapters import DEEPSEEK
from chainspec.models.config import ModelConfig, RopeConfig, eos_ids
from chainspec.models.families.base import DecoderParts, Family, MTPBlock
from chainspec.models.layers import MLP, RMSNorm
from chainspec.models.mla import LatentDecoderLayer, MLAShape
from chainspec.models.moe import MoEConfig, Scoring, SparseMoE, sparse_layers
from chainspec.models.rope import RotaryEmbedding

FIRST_K_DENSE_DEFAULT = 3  # DeepseekV3Config's, for a config.json without the field


@dataclass(frozen=True)
class DeepseekV3Config(ModelConfig):
    """`head_dim` is the query/key width Dn + Dr (the default scale of dense backends)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    attention_bias: bool = False
    softmax_scale: float = 1.0
    moe: MoEConfig | None = None  # the MoE kind's shape (None: every layer dense)
    sparse: tuple[bool, ...] = ()  # per target layer: MoE (True) or dense SwiGLU

    @property
    def mtp_sparse(self) -> bool:
        """The MTP layer's MLP kind: the last target layer's (released checkpoints: MoE)."""
        return bool(self.sparse) and self.sparse[-1]

    @property
    def mla(self) -> MLAShape:
        return MLAShape(self.hidden_size, self.num_heads, self.q_lora_rank, self.kv_lora_rank,
                        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                        self.softmax_scale, self.rope_interleave, self.attention_bias)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_and_scale(cfg: dict[str, Any], qk_head_dim: int) -> tuple[RopeConfig, float]:
    """RoPE over the Dr channels, and the softmax scale: yarn's `mscale_all_dim` enters
    it squared, and `mscale / mscale_all_dim` the cos/sin (as DeepSeek and HF do)."""
    rope = RopeConfig.from_hf(cfg)
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    scale = qk_head_dim ** -0.5
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if rope.type == "yarn" and rope.attention_factor is None and mscale and all_dim:
        rope = replace(rope, attention_factor=_mscale(rope.factor, mscale)
                       / _mscale(rope.factor, all_dim))
    if rope.type != "default" and all_dim:
        scale *= _mscale(rope.factor, all_dim) ** 2
    return rope, scale


def moe_layers(cfg: dict[str, Any], layers: int) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    """The MoE shape and the per-layer pattern (`moe.sparse_layers`): transformers builds
    the MoE block from layer `first_k_dense_replace` on, DeepSeek's router (sigmoid,
    noaux_tc, norm_topk_prob default True)."""
    sparse = sparse_layers(cfg, layers)
    if not any(sparse):
        return None, sparse
    return MoEConfig.from_hf(cfg, Scoring.SIGMOID, norm_default=True), sparse


def parse(cfg: dict[str, Any], arch: str) -> DeepseekV3Config:
    layers = int(cfg["num_hidden_layers"])
    cfg = {"first_k_dense_replace": FIRST_K_DENSE_DEFAULT, **cfg}  # transformers' default
    return _parse(cfg, arch, *moe_layers(cfg, layers))


def _parse(cfg: dict[str, Any], arch: str, moe: MoEConfig | None, sparse: tuple[bool, ...]
           ) -> DeepseekV3Config:
    """The MLA model's fields, with the MoE shape and pattern a family computed."""
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    nope, rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    rope, scale = _rope_and_scale(cfg, nope + rope_dim)
    q_rank = cfg.get("q_lora_rank")
    return DeepseekV3Config(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,  # NOTE: MLA has one latent head; num_key_value_heads is unused
        head_dim=nope + rope_dim,
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope=rope,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        softmax_scale=scale,
        moe=moe,
        sparse=sparse,
    )


def _rotary(cfg: DeepseekV3Config, cache_len: int | None) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position, cache_len)


def _layer(cfg: DeepseekV3Config, layer_id: int, rotary: RotaryEmbedding, sparse: bool
           ) -> LatentDecoderLayer:
    mlp = SparseMoE(cfg.moe) if sparse and cfg.moe is not None else MLP(cfg)
    return LatentDecoderLayer(cfg.mla, cfg.rms_eps, layer_id, rotary, mlp)


def build(cfg: DeepseekV3Config, cache_len: int | None) -> DecoderParts:
    rotary = _rotary(cfg, cache_len)
    sparse = cfg.sparse or (False,) * cfg.num_layers
    layers = [_layer(cfg, i, rotary, sparse[i]) for i in range(cfg.num_layers)]
    return DecoderParts(layers, [rotary], RMSNorm(cfg.hidden_size, cfg.rms_eps))


def mtp_block(cfg: DeepseekV3Config, cache_len: int | None) -> MTPBlock:
    """The MTP module's layer: MLA + the last target layer's MLP kind
    (`model.layers.{N+i}.self_attn.*`, `.mlp.*` -- the MoE's gate, experts and shared
    experts on released checkpoints --, `.input_layernorm`, `.post_attention_layernorm`)."""
    rotary = _rotary(cfg, cache_len)
    return MTPBlock(_layer(cfg, 0, rotary, cfg.mtp_sparse), [rotary])


DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    parse=parse, build=build, mtp=DEEPSEEK, mtp_block=mtp_block,
    notes="MLA (latent paged cache) + dense SwiGLU / sigmoid-routed MoE; MTP at "
          "model.layers.{N+i} (MLA + MoE block), chained, reads h after the final norm",
)
FAMILIES = (DEEPSEEK_V3,)

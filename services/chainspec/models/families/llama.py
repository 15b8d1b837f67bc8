"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 (q/k norm) and MiMo (a
Qwen2-shaped target whose MTP layers are `model.mtp_layers.*`).

Layer kinds: `full` attention (GQA, RoPE, optional q/k/v bias and q/k RMSNorm) and a
`dense` SwiGLU MLP on every layer. Tensor names are Hugging Face's, one to one.
MTP: DeepSeek naming (`model.layers.{N+i}.*`, [emb, hidden] concat) for targets that
declare `num_nextn_predict_layers` (the demo model, `train-mtp` output); MiMo's own.
"""

from __future__ import annotations

from typing import Any

from chainspec.models.adapters import DEEPSEEK, MIMO
from chainspec.models.config import ModelConfig, RopeConfig, eos_ids
from chainspec.models.families.base import DecoderParts, Family, MTPBlock
from chainspec.models.layers import DecoderLayer, RMSNorm
from chainspec.models.rope import RotaryEmbedding

# The switches that distinguish the members (q/k/v bias, q/k RMSNorm).
MEMBERS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "MiMoForCausalLM": {"qkv_bias": True, "qk_norm": False},
}


def parse(cfg: dict[str, Any], arch: str) -> ModelConfig:
    member = MEMBERS[arch]
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    qkv_bias = bool(cfg.get("attention_bias", member["qkv_bias"]))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias or member["qkv_bias"],
        o_bias=bool(cfg.get("attention_bias", False)) and not member["qkv_bias"],
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=member["qk_norm"],
        rope=RopeConfig.from_hf(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
    )


def build(cfg: ModelConfig, cache_len: int | None) -> DecoderParts:
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position, cache_len)
    layers = [DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers)]
    return DecoderParts(layers, [rotary], RMSNorm(cfg.hidden_size, cfg.rms_eps))


def mtp_block(cfg: ModelConfig, cache_len: int | None) -> MTPBlock:
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position, cache_len)
    return MTPBlock(DecoderLayer(cfg, 0, rotary), [rotary])


LLAMA = Family(
    name="llama",
    architectures=tuple(a for a in MEMBERS if a != "MiMoForCausalLM"),
    parse=parse, build=build, mtp=DEEPSEEK, mtp_block=mtp_block,
    notes="full GQA attention + dense SwiGLU; MTP (optional) in DeepSeek layout, chained, "
          "reads h after the final norm",
)
MIMO_V1 = Family(
    name="mimo",
    architectures=("MiMoForCausalLM",),
    parse=parse, build=build, mtp=MIMO, mtp_block=mtp_block,
    notes="Qwen2-shaped target; MTP at model.mtp_layers.{i}, [hidden, emb] concat",
)
FAMILIES = (LLAMA, MIMO_V1)

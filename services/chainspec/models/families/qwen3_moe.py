"""The Qwen3-MoE family (`Qwen3MoeForCausalLM`): GQA with q/k norm + softmax-routed MoE.

Layer kinds: `full` attention (layers.Attention: GQA, q/k RMSNorm, q/k/v and o_proj bias
from `attention_bias`, full RoPE); MLP `moe` (models/moe.py: softmax top-k, the top-k
weights renormalised with `norm_topk_prob`, no shared experts) on the layers
`decoder_sparse_step` picks outside `mlp_only_layers`, `dense` (SwiGLU of
`intermediate_size`) on the others. `use_sliding_window` is refused by name. Tensor
names are Hugging Face's, one to one; experts load per expert or stacked. The stack and
its blocks are `glm4_moe.py`'s (the same kinds, other switches).

MTP glue: Qwen3-MoE releases ship no MTP layers; `train-mtp` writes modules in DeepSeek's
layout (`adapters.DEEPSEEK`, as for the Llama family):

| what | Qwen3-MoE (train-mtp modules) |
|---|---|
| where | `model.layers.{N+i}.*`, N = num_hidden_layers; `num_nextn_predict_layers` |
| glue | `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` |
| concat | [enorm(Emb(x[p+k])), hnorm(g[k-1][p])] |
| chain | yes: step k reads step k-1's block output (before `shared_head.norm`) |
| hidden read | the target's h after the final norm |
| token offset | step k at row p reads x[p+k] and predicts x[p+k+1] |
| layer kind | the family's decoder layer at index N (the layer pattern's kind there: MoE |
| | with `decoder_sparse_step` 1) |
"""

from __future__ import annotations

from typing import Any

from chainspec.models.adapters import DEEPSEEK
from chainspec.models.config import RopeConfig, eos_ids
from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import Family
from chainspec.models.families.glm4_moe import (
    MoEStackConfig,
    build,
    check_activation,
    moe_pattern,
    mtp_block,
)
from chainspec.models.moe import Scoring


def parse(cfg: dict[str, Any], arch: str) -> MoEStackConfig:
    check_activation(cfg, arch)
    if cfg.get("use_sliding_window"):
        raise CheckpointError(f"{arch}: use_sliding_window=true is not supported")
    layers, heads, hidden = (int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]),
                             int(cfg["hidden_size"]))
    moe, pattern = moe_pattern(cfg, layers, Scoring.SOFTMAX, False)
    bias = bool(cfg.get("attention_bias", False))
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
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        rope=RopeConfig.from_hf(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        moe=moe,
        sparse=pattern[:layers],
        mtp_sparse=pattern[layers],
    )


QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    parse=parse, build=build, mtp=DEEPSEEK, mtp_block=mtp_block,
    notes="full GQA with q/k norm + MoE (softmax top-k, norm_topk_prob) by "
          "decoder_sparse_step / mlp_only_layers; no shipped MTP: train-mtp modules in "
          "DeepSeek layout, chained, read h after the final norm",
)
FAMILIES = (QWEN3_MOE,)

"""Tiny random GLM-4.7-Flash checkpoints: the target written by transformers' own
`Glm4MoeLiteForCausalLM.save_pretrained` (experts per expert on disk), and the NextN
layer in the layout vLLM's / SGLang's GLM-4.7-Flash MTP reads (DeepSeek-V3's:
`model.layers.{N+i}.` + `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
`shared_head.head`, `embed_tokens` and a decoder layer with an MoE MLP), spelled out
here, not taken from chainspec's adapter, in a separate `mtp.safetensors`. The NextN
decoder layer is transformers' own `Glm4MoeLiteDecoderLayer` built as a sparse layer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteDecoderLayer

from tests.unit.families.deepseek_v3_checkpoint import (
    _quiet_residuals,
    _randomise,
    per_expert,
)

LAYERS = 3
# layer 0 dense, 1 and 2 MoE (transformers' default pattern spelled out); 8 experts in 4
# groups, the 2 best kept, top-2, one shared expert, GLM's scaling 1.8.
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
             q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
             topk_group=2, n_shared_experts=1, routed_scaling_factor=1.8, norm_topk_prob=True,
             mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=256,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
             eos_token_id=None, bos_token_id=None, pad_token_id=None,
             tie_word_embeddings=False, num_nextn_predict_layers=1)


def hf_config(**extra) -> Glm4MoeLiteConfig:
    return Glm4MoeLiteConfig(**{**SHAPE, **extra})


def write_target(path: Path, seed: int = 0, quiet: float = 1.0, **extra
                 ) -> Glm4MoeLiteForCausalLM:
    torch.manual_seed(seed)
    model = Glm4MoeLiteForCausalLM(hf_config(**extra)).eval()
    _randomise(model, torch.Generator().manual_seed(seed))
    _quiet_residuals(model, quiet)
    model.save_pretrained(path)
    return model


def mtp_prefix(cfg: Glm4MoeLiteConfig, i: int) -> str:
    return f"model.layers.{cfg.num_hidden_layers + i}."


def mtp_tensors(cfg: Glm4MoeLiteConfig, embed: torch.Tensor, head: torch.Tensor,
                seed: int = 1, final_norm: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
    """One random NextN layer; `final_norm` (the target's): an agreeing drafter for a quiet
    target (see deepseek_v3_checkpoint.mtp_tensors)."""
    gen, h = torch.Generator().manual_seed(seed), cfg.hidden_size
    p = mtp_prefix(cfg, 0)
    sparse = cfg.mlp_layer_types.index("sparse")
    layer = Glm4MoeLiteDecoderLayer(cfg, layer_idx=sparse)  # built as a sparse layer
    _randomise(layer, gen)
    eh = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    if final_norm is not None:
        _quiet_residuals(layer, 0.1)
        eh = torch.cat([torch.eye(h), 0.3 * eh[:, h:]], dim=1)
    out = per_expert(p, layer.state_dict())
    out[p + "enorm.weight"] = (torch.ones(h) if final_norm is not None
                               else 1.0 + 0.2 * torch.randn(h, generator=gen))
    out[p + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(h, generator=gen)
    out[p + "eh_proj.weight"] = eh
    out[p + "shared_head.norm.weight"] = (final_norm.clone() if final_norm is not None
                                          else 1.0 + 0.2 * torch.randn(h, generator=gen))
    out[p + "embed_tokens.weight"] = embed.clone()
    out[p + "shared_head.head.weight"] = head.clone()
    return out


def write_with_mtp(path: Path, seed: int = 0, agreeing: bool = False, **extra
                   ) -> tuple[Glm4MoeLiteForCausalLM, dict[str, torch.Tensor]]:
    model = write_target(path, seed, 0.05 if agreeing else 1.0, **extra)
    norm = model.model.norm.weight.detach() if agreeing else None
    tensors = mtp_tensors(model.config, model.model.embed_tokens.weight.detach(),
                          model.lm_head.weight.detach(), seed + 1, norm)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return model, tensors

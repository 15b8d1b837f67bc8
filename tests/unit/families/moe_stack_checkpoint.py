"""Tiny random GLM-4.5 (`Glm4MoeForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`)
checkpoints: the target written by transformers' own `save_pretrained` (experts stored per
expert, as the hub does), and MTP layers in DeepSeek's placement, which is GLM's NextN
layout (vLLM `glm4_moe_mtp.py`, SGLang `glm4_moe_nextn.py`): `model.layers.{N+i}.` +
`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, `shared_head.head`, `embed_tokens` and
the family's own decoder layer (transformers' class built at index N: MoE), names spelled
out here independently of chainspec's adapter, in a separate `mtp.safetensors`, experts
per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=16, num_experts_per_tok=2, max_position_embeddings=256,
            eos_token_id=None, tie_word_embeddings=False)
# layer 0 dense, 1..2 MoE; 8 experts in 4 groups, the best 2 groups kept; 1 shared expert
GLM = dict(BASE, n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=1,
           routed_scaling_factor=2.5, first_k_dense_replace=1, attention_bias=True,
           use_qk_norm=True, num_nextn_predict_layers=1)
# layers 0 and 2 MoE, 1 dense (mlp_only_layers); 8 experts, top-k renormalised
QWEN = dict(BASE, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1],
            decoder_sparse_step=1)
FAMILIES = {
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeDecoderLayer, GLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeDecoderLayer, QWEN),
}
QUIET = 0.02  # MoE layers add more than dense ones (routed scaling, shared experts)
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


def hf_config(family: str, **extra):
    config_class, _, _, shape = FAMILIES[family]
    return config_class(**{**shape, **extra})


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every tensor random: norms near 1, matrices scaled by fan-in, correction biases
    large enough to move the expert choice."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def _quiet_residuals(model: torch.nn.Module, factor: float) -> None:
    """Scale what attention and MLPs add to the residual stream."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(RESIDUAL_OUTPUTS):
                p.mul_(factor)


def write_target(path: Path, family: str, seed: int = 0, quiet: float = 1.0, **extra):
    """Save a random transformers target to `path`; return it (eval, fp32). `quiet` < 1:
    the layers add little, so the next token depends mostly on the last one."""
    _, model_class, _, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(hf_config(family, **extra)).eval()
    _randomise(model, torch.Generator().manual_seed(seed))
    _quiet_residuals(model, quiet)
    model.save_pretrained(path)
    return model


def mtp_prefix(cfg, i: int) -> str:
    return f"model.layers.{cfg.num_hidden_layers + i}."


def per_expert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked expert parameter in the hub's layout: one tensor per expert and part."""
    prefix, param = name.rsplit(".", 1)
    if param == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": t.clone() for e, t in enumerate(tensor)}
    width = tensor.shape[1] // 2
    out = {}
    for e, t in enumerate(tensor):
        out[f"{prefix}.{e}.gate_proj.weight"] = t[:width].clone()
        out[f"{prefix}.{e}.up_proj.weight"] = t[width:].clone()
    return out


def mtp_layer(family: str, cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The family's decoder layer at index N, random, its experts per expert."""
    _, _, layer_class, _ = FAMILIES[family]
    layer = layer_class(cfg, layer_idx=cfg.num_hidden_layers)
    _randomise(layer, gen)
    out = {}
    for name, t in layer.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out.update(per_expert(name, t))
        else:
            out[name] = t.detach().clone()
    return out


def mtp_tensors(family: str, cfg, embed: torch.Tensor, head: torch.Tensor,
                num_layers: int = 1, seed: int = 1, final_norm: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
    """`num_layers` random MTP layers. `final_norm` (the target's): an agreeing drafter
    for a quiet target -- eh_proj passes enorm(Emb(x[p+k])) through (plus a little of the
    hidden state), the block adds little, and the head norm is the target's."""
    gen, h, out = torch.Generator().manual_seed(seed), cfg.hidden_size, {}
    for i in range(num_layers):
        p = mtp_prefix(cfg, i)
        layer = mtp_layer(family, cfg, gen)
        eh = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
        if final_norm is not None:
            layer = {k: v * 0.1 if k.endswith(("o_proj.weight", "down_proj.weight")) else v
                     for k, v in layer.items()}
            eh = torch.cat([torch.eye(h), 0.3 * eh[:, h:]], dim=1)
        out.update({p + k: v for k, v in layer.items()})
        out[p + "enorm.weight"] = (torch.ones(h) if final_norm is not None
                                   else 1.0 + 0.2 * torch.randn(h, generator=gen))
        out[p + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(h, generator=gen)
        out[p + "eh_proj.weight"] = eh
        out[p + "shared_head.norm.weight"] = (final_norm.clone() if final_norm is not None
                                              else 1.0 + 0.2 * torch.randn(h, generator=gen))
        out[p + "embed_tokens.weight"] = embed.clone()  # the NextN layer's copies
        out[p + "shared_head.head.weight"] = head.clone()
    return out


def write_with_mtp(path: Path, family: str, num_layers: int = 1, seed: int = 0,
                   agreeing: bool = False, **extra):
    """A target plus `num_layers` MTP layers (config says so); returns both. `agreeing`:
    a quiet target and a drafter that often guesses it (drafts at stake)."""
    model = write_target(path, family, seed, QUIET if agreeing else 1.0,
                         num_nextn_predict_layers=num_layers, **extra)
    norm = model.model.norm.weight.detach() if agreeing else None
    tensors = mtp_tensors(family, model.config, model.model.embed_tokens.weight.detach(),
                          model.lm_head.weight.detach(), num_layers, seed + 1, norm)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return model, tensors

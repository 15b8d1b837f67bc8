"""Tiny random DeepSeek-V3 checkpoints (dense layers): the target written by transformers'
own `DeepseekV3ForCausalLM.save_pretrained`, and the MTP layers in the real layout
(vLLM's / SGLang's `deepseek_mtp`: `model.layers.{N+i}.` + `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, `shared_head.head`, `embed_tokens` and a decoder layer's
`self_attn.*` / `mlp.*` / norms), names spelled out here independently of chainspec's
adapter, in a separate `mtp.safetensors`. The MTP decoder layer is transformers' own
`DeepseekV3DecoderLayer`: dense for an all-dense target, else MoE like the released
block, its experts written per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj`,
the hub's layout) beside `mlp.gate.weight`, `mlp.gate.e_score_correction_bias` and
`mlp.shared_experts.*`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

LAYERS = 2
# Every layer dense (first_k_dense_replace = layers); MLA with both ranks.
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
             first_k_dense_replace=LAYERS, n_routed_experts=4, num_experts_per_tok=2,
             n_group=1, topk_group=1, max_position_embeddings=256, eos_token_id=None,
             tie_word_embeddings=False, num_nextn_predict_layers=1)
# MoE from layer 1 on (and in the MTP layer): 8 experts in 4 groups, the 2 best groups
# kept, top-2, one shared expert, DeepSeek's scaling; what `first_k_dense_replace=1` needs.
MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
           topk_group=2, moe_intermediate_size=16, n_shared_experts=1,
           routed_scaling_factor=2.5, norm_topk_prob=True)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0,
        "rope_theta": 10000.0}


def hf_config(**extra) -> DeepseekV3Config:
    return DeepseekV3Config(**{**SHAPE, **extra})


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Every tensor random: norms near 1, matrices (and stacked experts) scaled by fan-in,
    router correction biases around 0 (they change which experts are chosen)."""
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
    """Scale what attention and MLPs add to the residual stream (o_proj, down_proj)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(factor)


def write_target(path: Path, seed: int = 0, quiet: float = 1.0, **extra
                 ) -> DeepseekV3ForCausalLM:
    """Save a random transformers target to `path`; return it (eval, fp32). `quiet` < 1:
    the layers add little, so the next token depends mostly on the last one."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(**extra)).eval()
    _randomise(model, torch.Generator().manual_seed(seed))
    _quiet_residuals(model, quiet)
    model.save_pretrained(path)
    return model


def mtp_prefix(cfg: DeepseekV3Config, i: int) -> str:
    return f"model.layers.{cfg.num_hidden_layers + i}."


def per_expert(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's state with stacked experts (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]) written per expert, as the hub stores them."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("experts.gate_up_proj"):
            base = k.removesuffix("gate_up_proj")
            for e, w in enumerate(v):
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{base}{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}{base}{e}.up_proj.weight"] = up.clone()
        elif k.endswith("experts.down_proj"):
            base = k.removesuffix("down_proj")
            out.update({f"{prefix}{base}{e}.down_proj.weight": w.clone()
                        for e, w in enumerate(v)})
        else:
            out[prefix + k] = v.detach().clone()
    return out


def mtp_layer_index(cfg: DeepseekV3Config) -> int:
    """The index transformers' layer is built with: N (MoE) when the target has MoE
    layers, else 0 (dense)."""
    n = cfg.num_hidden_layers
    return n if cfg.first_k_dense_replace < n else 0


def mtp_tensors(cfg: DeepseekV3Config, embed: torch.Tensor, head: torch.Tensor,
                num_layers: int = 1, seed: int = 1, final_norm: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
    """`num_layers` random MTP layers in DeepSeek's layout. `final_norm` (the target's):
    an agreeing drafter for a quiet target -- eh_proj passes enorm(Emb(x[p+k])) through
    (plus a little of the hidden state), the block adds little, and the head norm is the
    target's, so step k guesses the target's next token from x[p+k] alone."""
    gen, h, out = torch.Generator().manual_seed(seed), cfg.hidden_size, {}
    for i in range(num_layers):
        p = mtp_prefix(cfg, i)
        layer = DeepseekV3DecoderLayer(cfg, layer_idx=mtp_layer_index(cfg))
        _randomise(layer, gen)
        eh = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
        if final_norm is not None:
            _quiet_residuals(layer, 0.1)
            eh = torch.cat([torch.eye(h), 0.3 * eh[:, h:]], dim=1)
        out.update(per_expert(p, layer.state_dict()))
        out[p + "enorm.weight"] = (torch.ones(h) if final_norm is not None
                                   else 1.0 + 0.2 * torch.randn(h, generator=gen))
        out[p + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(h, generator=gen)
        out[p + "eh_proj.weight"] = eh
        out[p + "shared_head.norm.weight"] = (final_norm.clone() if final_norm is not None
                                              else 1.0 + 0.2 * torch.randn(h, generator=gen))
        out[p + "embed_tokens.weight"] = embed.clone()  # DeepSeek's per-layer copies
        out[p + "shared_head.head.weight"] = head.clone()
    return out


def write_with_mtp(path: Path, num_layers: int = 1, seed: int = 0, agreeing: bool = False,
                   **extra) -> tuple[DeepseekV3ForCausalLM, dict[str, torch.Tensor]]:
    """A target plus `num_layers` MTP layers (config says so); returns both. `agreeing`:
    a quiet target and a drafter that often guesses it (drafts at stake)."""
    model = write_target(path, seed, 0.05 if agreeing else 1.0,
                         num_nextn_predict_layers=num_layers, **extra)
    norm = model.model.norm.weight.detach() if agreeing else None
    tensors = mtp_tensors(model.config, model.model.embed_tokens.weight.detach(),
                          model.lm_head.weight.detach(), num_layers, seed + 1, norm)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "mtp.safetensors"))
    return model, tensors

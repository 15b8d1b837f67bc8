"""Tiny random Qwen3-Next and Qwen3.5-MoE checkpoints: the target written by transformers'
own `save_pretrained`, and the MTP layer in the real layout (vLLM's `qwen3_next_mtp.py` /
`qwen3_5_mtp.py`: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0.*` -- a gated full-attention layer with an MoE MLP -- and `mtp.norm`), names
spelled out here independently of chainspec's adapter, in a separate `mtp.safetensors`.
Qwen3-Next's MTP experts are written per expert (`experts.{e}.gate_proj.weight`, as the
hub's Qwen3-Next-80B-A3B stores them), Qwen3.5-MoE's fused (`experts.gate_up_proj`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

# 4 layers: linear, linear, linear, full; GQA on both kinds; 4 experts, top-2.
SHAPE = dict(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, max_position_embeddings=256, eos_token_id=None,
             tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=16, shared_expert_intermediate_size=24)
# Qwen3-Next: layer 1 dense (mlp_only_layers), the others and the MTP layer MoE.
NEXT = dict(intermediate_size=48, mlp_only_layers=[1], decoder_sparse_step=1)
FAMILIES = {"qwen3_next": (Qwen3NextForCausalLM, Qwen3NextConfig, NEXT),
            "qwen3_5_moe": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, {})}


def hf_config(family: str, **extra):
    _, config, own = FAMILIES[family]
    return config(**{**SHAPE, **own, **extra})


def _randomise(named: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Every tensor random: zero-centred norms near 0, the GDN's gated norm near 1, A_log
    so that decays spread over (0, 1), router weights large enough that choices vary."""
    for name, p in named.items():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
        elif p.dim() == 1:
            base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.8 / p.shape[-1] ** 0.5))


def write_target(family: str, path: Path, seed: int = 0, **extra):
    """Save a random transformers target to `path`; return it (eval, fp32)."""
    model_cls = FAMILIES[family][0]
    torch.manual_seed(seed)
    model = model_cls(hf_config(family, **extra)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _randomise(dict(model.named_parameters()), gen)
    model.save_pretrained(path)
    return model


def mtp_shapes(family: str, cfg, num_layers: int = 1) -> dict[str, tuple[int, ...]]:
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    i, s = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for n in range(num_layers):
        p = f"mtp.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (2 * q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate.weight": (e, h), p + "mlp.shared_expert_gate.weight": (1, h),
            p + "mlp.shared_expert.gate_proj.weight": (s, h),
            p + "mlp.shared_expert.up_proj.weight": (s, h),
            p + "mlp.shared_expert.down_proj.weight": (h, s)})
        if family == "qwen3_next":  # per expert
            for x in range(e):
                shapes.update({p + f"mlp.experts.{x}.gate_proj.weight": (i, h),
                               p + f"mlp.experts.{x}.up_proj.weight": (i, h),
                               p + f"mlp.experts.{x}.down_proj.weight": (h, i)})
        else:  # fused
            shapes.update({p + "mlp.experts.gate_up_proj": (e, 2 * i, h),
                           p + "mlp.experts.down_proj": (e, h, i)})
    return shapes


def write_mtp(family: str, path: Path, cfg, seed: int = 1, drop: str | None = None,
              reshape: str | None = None) -> dict[str, torch.Tensor]:
    """Random MTP tensors in `mtp.safetensors`; `drop` leaves one out, `reshape` gives one
    a wrong shape. Returns what was written."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.empty(shape) for name, shape in mtp_shapes(family, cfg).items()}
    with torch.no_grad():
        _randomise(tensors, gen)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(tensors[reshape].shape[0] + 1,
                                       *tensors[reshape].shape[1:])
    save_file(tensors, str(path / "mtp.safetensors"))
    return tensors


def write_checkpoint(family: str, path: Path, seed: int = 0, **extra):
    """Target and one MTP layer (config `mtp_num_hidden_layers` 1)."""
    model = write_target(family, path, seed, mtp_num_hidden_layers=1, **extra)
    write_mtp(family, path, model.config, seed + 1)
    return model


def fused_mtp_block(tensors: dict[str, torch.Tensor], prefix: str = "mtp.layers.0."
                    ) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors relative to `prefix`, experts stacked as transformers' modules
    hold them ([E, 2I, H] gate rows then up rows, [E, H, I])."""
    own = {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
    per = sorted({int(n.split(".")[2]) for n in own if n.startswith("mlp.experts.")
                  and n.split(".")[2].isdigit()})
    if per:
        own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
            [own.pop(f"mlp.experts.{e}.gate_proj.weight"),
             own.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in per])
        own["mlp.experts.down_proj"] = torch.stack(
            [own.pop(f"mlp.experts.{e}.down_proj.weight") for e in per])
    return own


def write_qwen3_5_moe_release(path: Path, seed: int = 0):
    """A random Qwen3.5-MoE release (`Qwen3_5MoeForConditionalGeneration.save_pretrained`:
    nested text_config, `model.language_model.*`, a tiny vision tower `model.visual.*`)
    plus the MTP layer `mtp.*`; returns the transformers model (eval)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from tests.unit.families.release_checkpoint import VISION
    text = {**SHAPE, "mtp_num_hidden_layers": 1}
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        _randomise(dict(model.named_parameters()), torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    write_mtp("qwen3_5_moe", path, model.config.text_config, seed + 1)
    return model

"""Tiny random Qwen3.5 checkpoints: the target written by transformers' own
`Qwen3_5ForCausalLM.save_pretrained`, and the MTP layer in the real layout (vLLM's
`qwen3_5_mtp.py`: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0.*` -- a gated full-attention layer -- and `mtp.norm`), names spelled out here
independently of chainspec's adapter, in a separate `mtp.safetensors`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

# 4 layers: linear, linear, linear, full (the default interval 4); GQA on both kinds.
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
             eos_token_id=None, tie_word_embeddings=False)


def hf_config(**extra) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**{**SHAPE, **extra})


def _randomise(named: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Every tensor random: zero-centred norms near 0, the GDN's gated norm near 1, A_log
    so that decays spread over (0, 1)."""
    for name, p in named.items():
        if name.endswith("A_log"):
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
        elif p.dim() == 1:
            base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            fan_in = p[0].numel()
            p.copy_(torch.randn(p.shape, generator=gen) * (0.8 / fan_in ** 0.5))


def write_target(path: Path, seed: int = 0, **extra) -> Qwen3_5ForCausalLM:
    """Save a random transformers target to `path`; return it (eval, fp32)."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hf_config(**extra)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _randomise(dict(model.named_parameters()), gen)
    model.save_pretrained(path)
    return model


def mtp_shapes(cfg: Qwen3_5TextConfig, num_layers: int = 1) -> dict[str, tuple[int, ...]]:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for n in range(num_layers):
        p = f"mtp.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (2 * q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,)})
    return shapes


def write_mtp(path: Path, cfg: Qwen3_5TextConfig, seed: int = 1, num_layers: int = 1,
              drop: str | None = None, reshape: str | None = None) -> dict[str, torch.Tensor]:
    """Random MTP tensors in `mtp.safetensors`; `drop` leaves one out, `reshape` gives one
    a wrong shape. Returns what was written."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.empty(shape) for name, shape in mtp_shapes(cfg, num_layers).items()}
    with torch.no_grad():
        _randomise(tensors, gen)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(tensors[reshape].shape[0] + 1,
                                       *tensors[reshape].shape[1:])
    save_file(tensors, str(path / "mtp.safetensors"))
    return tensors


def write_checkpoint(path: Path, seed: int = 0, **extra) -> Qwen3_5ForCausalLM:
    """Target and one MTP layer (config `mtp_num_hidden_layers` 1)."""
    model = write_target(path, seed, mtp_num_hidden_layers=1, **extra)
    write_mtp(path, model.config, seed + 1)
    return model

"""Tiny random MiMo-V2-Flash checkpoints: the target written by transformers' own
`MiMoV2FlashForCausalLM.save_pretrained` (dense MLPs on every layer: `mlp_layer_types`
all "dense"; a tiny window of 8 over block size 4), and three MTP layers in the hub's
layout (`model.mtp.layers.{i}.*`, as SGLang's `mimo_v2_flash_nextn.py` and vLLM's
`mimo_v2_mtp.py` read them), names spelled out here independently of chainspec's adapter,
in a separate `mtp.safetensors`; config `num_nextn_predict_layers` 3."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

WINDOW = 8
LAYERS = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, v_head_dim=8,
             sliding_window=WINDOW, layer_types=LAYERS, mlp_layer_types=["dense"] * 4,
             max_position_embeddings=256, eos_token_id=None, tie_word_embeddings=False)
NUM_MTP = 3


def hf_config(**extra) -> MiMoV2FlashConfig:
    return MiMoV2FlashConfig(**{**SHAPE, **extra})


def _randomise(named: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Every tensor random: norms near 1, sinks spread around 0, matrices ~1/sqrt(fan_in)."""
    for name, p in named.items():
        if name.endswith("attention_sink_bias"):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p[0].numel() ** 0.5))


def write_target(path: Path, seed: int = 0, **extra) -> MiMoV2FlashForCausalLM:
    torch.manual_seed(seed)
    model = MiMoV2FlashForCausalLM(hf_config(**extra)).eval()
    with torch.no_grad():
        _randomise(dict(model.named_parameters()), torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return model


def mtp_shapes(cfg: MiMoV2FlashConfig, num_layers: int = NUM_MTP) -> dict[str, tuple]:
    """The MTP layers' tensors: SWA shape (twice the kv heads, sinks), dense MLP."""
    h, i, d, dv = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.v_head_dim
    hq, hkv = cfg.num_attention_heads, 2 * cfg.num_key_value_heads
    shapes = {}
    for n in range(num_layers):
        p = f"model.mtp.layers.{n}."
        shapes.update({
            p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
            p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (hq * d, h),
            p + "self_attn.k_proj.weight": (hkv * d, h),
            p + "self_attn.v_proj.weight": (hkv * dv, h),
            p + "self_attn.o_proj.weight": (h, hq * dv),
            p + "self_attn.attention_sink_bias": (hq,),
            p + "pre_mlp_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "final_layernorm.weight": (h,)})
    return shapes


def write_mtp(path: Path, cfg: MiMoV2FlashConfig, seed: int = 1, drop: str | None = None,
              reshape: str | None = None) -> dict[str, torch.Tensor]:
    """Random MTP tensors in `mtp.safetensors` and `num_nextn_predict_layers` in the
    config; `drop` leaves one out, `reshape` gives one a wrong shape."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.empty(shape) for name, shape in mtp_shapes(cfg).items()}
    with torch.no_grad():
        _randomise(tensors, gen)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(tensors[reshape].shape[0] + 1,
                                       *tensors[reshape].shape[1:])
    save_file(tensors, str(path / "mtp.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = NUM_MTP
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def write_checkpoint(path: Path, seed: int = 0, **extra) -> MiMoV2FlashForCausalLM:
    model = write_target(path, seed, **extra)
    write_mtp(path, model.config, seed + 1)
    return model

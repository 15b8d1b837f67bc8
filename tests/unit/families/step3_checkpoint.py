"""Tiny random Step-3.5-Flash checkpoints (`Step3p5ForCausalLM`): the decoder is
transformers' own `Step3p7TextModel` (config model_type `step3p5`, dense MLPs on every
layer), saved as the hub lays it out (`model.*`, `lm_head.weight`), and three MTP layers
in the hub's layout (`model.layers.{N+i}.*` with `shared_head.norm` and
`shared_head.output`, as SGLang's and vLLM's `step3p5_mtp.py` read them), names spelled out
here independently of chainspec's adapter, in a separate `mtp.safetensors`.

Shapes that make mix-ups show: sliding layers have more query heads than full ones, the
two kinds have their own RoPE theta and partial factor, the scale is not head_dim's, one
layer's SwiGLU is clamped, a window of 8 over blocks of 4."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

WINDOW = 8
NUM_MTP = 3
FULL, SLIDING = "full_attention", "sliding_attention"
LAYERS = [FULL, SLIDING, SLIDING, FULL]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_sliding_attention_heads=6, num_key_value_heads=2, head_dim=16,
             query_pre_attn_scalar=12, sliding_window=WINDOW, max_position_embeddings=256,
             rms_norm_eps=1e-5, eos_token_id=None, pad_token_id=0,
             tie_word_embeddings=False)
# per-layer lists as the hub writes them: target layers then the MTP layers
PADDED = dict(layer_types=LAYERS + [SLIDING] * NUM_MTP,
              rope_theta=[50000.0, 10000.0, 10000.0, 50000.0] + [10000.0] * NUM_MTP,
              partial_rotary_factors=[0.5, 1.0, 1.0, 0.5] + [1.0] * NUM_MTP,
              swiglu_limits_shared=[0.0, 0.0, 0.4, 0.0] + [0.0] * NUM_MTP,
              moe_layers_enum="")


def hf_config(vocab_size: int = 256, **extra) -> Step3p7TextConfig:
    cfg = Step3p7TextConfig(vocab_size=vocab_size, num_nextn_predict_layers=NUM_MTP,
                            **{**SHAPE, **PADDED, **extra})
    cfg._attn_implementation = "eager"
    return cfg


class Step3p5CausalLM(torch.nn.Module):
    """transformers' text decoder and an LM head: the reference target."""

    def __init__(self, cfg: Step3p7TextConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Step3p7TextModel(cfg)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, **kwargs):
        out = self.model(input_ids=input_ids, **kwargs)
        return self.lm_head(out.last_hidden_state), out


def _randomise(named: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Every tensor random: zero-centred norms near 0 (scale 1 + w), matrices ~1/sqrt(fan_in)."""
    for p in named.values():
        if p.dim() == 1:
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p[0].numel() ** 0.5))


def write_target(path: Path, seed: int = 0, **extra) -> Step3p5CausalLM:
    torch.manual_seed(seed)
    cfg = hf_config(**extra)
    model = Step3p5CausalLM(cfg).eval()
    with torch.no_grad():
        _randomise(dict(model.named_parameters()), torch.Generator().manual_seed(seed))
    path.mkdir(parents=True, exist_ok=True)
    state = {f"model.{k}": v.contiguous() for k, v in model.model.state_dict().items()}
    state["lm_head.weight"] = model.lm_head.weight.detach().contiguous()
    save_file(state, str(path / "model.safetensors"))
    cfg.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Step3p5ForCausalLM"]
    config["torch_dtype"] = "float32"  # as a model save writes it
    (path / "config.json").write_text(json.dumps(config))
    return model


def mtp_shapes(cfg: Step3p7TextConfig, num_layers: int = NUM_MTP) -> dict[str, tuple]:
    """The MTP layers' tensors: sliding shape (sliding heads), dense MLP, own head."""
    h, i, d, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    hq, hkv = cfg.num_sliding_attention_heads, cfg.num_key_value_heads
    shapes = {}
    for n in range(num_layers):
        p = f"model.layers.{cfg.num_hidden_layers + n}."
        shapes.update({
            p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
            p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (hq * d, h),
            p + "self_attn.k_proj.weight": (hkv * d, h),
            p + "self_attn.v_proj.weight": (hkv * d, h),
            p + "self_attn.o_proj.weight": (h, hq * d),
            p + "self_attn.g_proj.weight": (hq, h),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "post_attention_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "shared_head.norm.weight": (h,), p + "shared_head.output.weight": (v, h)})
    return shapes


def write_mtp(path: Path, cfg: Step3p7TextConfig, seed: int = 1, drop: str | None = None,
              reshape: str | None = None) -> dict[str, torch.Tensor]:
    """Random MTP tensors in `mtp.safetensors` (the config already declares them);
    `drop` leaves one out, `reshape` gives one a wrong shape."""
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
    return tensors


def write_checkpoint(path: Path, seed: int = 0, **extra) -> Step3p5CausalLM:
    model = write_target(path, seed, **extra)
    write_mtp(path, model.config, seed + 1)
    return model

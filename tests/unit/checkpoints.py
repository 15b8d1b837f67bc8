"""Small random checkpoints written in Hugging Face layout, tensor names spelled out here
(independently of chainspec's adapters) so that tests check the loader's mapping."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# Glue tensor names per MTP family; `{p}` is the module's layer prefix.
FAMILY_GLUE = {
    "deepseek": {"enorm": "{p}enorm.weight", "hnorm": "{p}hnorm.weight",
                 "eh_proj": "{p}eh_proj.weight", "final_norm": "{p}shared_head.norm.weight"},
    "mimo": {"enorm": "{p}token_layernorm.weight", "hnorm": "{p}hidden_layernorm.weight",
             "eh_proj": "{p}input_proj.weight", "final_norm": "{p}final_layernorm.weight"},
    "qwen3_next": {"enorm": "mtp.pre_fc_norm_embedding.weight",
                   "hnorm": "mtp.pre_fc_norm_hidden.weight",
                   "eh_proj": "mtp.fc.weight", "final_norm": "mtp.norm.weight"},
}


def hf_config(arch: str = "LlamaForCausalLM", **overrides) -> dict:
    """A tiny HF config: 2 layers, hidden 32, 4 heads over 2 KV heads."""
    cfg = {"architectures": [arch], "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "eos_token_id": 2, "bos_token_id": 1}
    cfg.update(overrides)
    return cfg


def block_shapes(prefix: str, cfg: dict, qkv_bias: bool = False, qk_norm: bool = False
                 ) -> dict[str, tuple[int, ...]]:
    """One Llama-style decoder layer's tensors under `prefix`."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
              "post_attention_layernorm.weight": (h,)}
    if qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                       "self_attn.v_proj.bias": (kv,)})
    if qk_norm:
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return {prefix + name: shape for name, shape in shapes.items()}


def target_shapes(cfg: dict, qkv_bias: bool = False, qk_norm: bool = False
                  ) -> dict[str, tuple[int, ...]]:
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(cfg["num_hidden_layers"]):
        shapes.update(block_shapes(f"model.layers.{layer}.", cfg, qkv_bias, qk_norm))
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def mtp_prefix(family: str, i: int, cfg: dict) -> str:
    return {"deepseek": f"model.layers.{cfg['num_hidden_layers'] + i}.",
            "mimo": f"model.mtp_layers.{i}.", "qwen3_next": f"mtp.layers.{i}."}[family]


def mtp_shapes(family: str, cfg: dict, count: int, qkv_bias: bool = False,
               qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    """`count` MTP modules in `family` naming (embedding and head not included)."""
    h = cfg["hidden_size"]
    glue_shapes = {"enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h), "final_norm": (h,)}
    shapes = {}
    for i in range(count):
        p = mtp_prefix(family, i, cfg)
        shapes.update(block_shapes(p, cfg, qkv_bias, qk_norm))
        for part, template in FAMILY_GLUE[family].items():
            shapes[template.format(p=p)] = glue_shapes[part]
    return shapes


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0,
                   zero_centred_norms: bool = False) -> dict[str, torch.Tensor]:
    """Weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1), norm weights ~ 1 + N(0, 0.2) (or
    N(0, 0.2) when zero-centred): every tensor differs, so a swapped name shows."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        t = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            t = t * 0.2 + (0.0 if zero_centred_norms else 1.0)
        elif len(shape) == 1:
            t = t * 0.1
        elif "embed_tokens" not in name:
            t = t / shape[1] ** 0.5
        out[name] = t.contiguous()
    return out


def write_checkpoint(model_dir: Path, cfg: dict | None, files: dict[str, dict]) -> Path:
    """Write config.json (unless None) and safetensors files {file name: tensors}."""
    model_dir.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    for name, tensors in files.items():
        save_file(tensors, str(model_dir / name))
    return model_dir


def write_index(model_dir: Path, files: dict[str, dict]) -> None:
    """Write shards and a `model.safetensors.index.json` naming them."""
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, str(model_dir / name))
        weight_map.update({t: name for t in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


def demo_checkpoint(model_dir: Path, mtp: int = 3, tied: bool = False, seed: int = 0
                    ) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The demo layout: a Llama target in model.safetensors and DeepSeek-named MTP modules
    in mtp.safetensors. Returns (config, target tensors, MTP tensors)."""
    cfg = hf_config(num_nextn_predict_layers=mtp, tie_word_embeddings=tied)
    target = random_tensors(target_shapes(cfg), seed)
    modules = random_tensors(mtp_shapes("deepseek", cfg, mtp), seed + 1)
    write_checkpoint(model_dir, cfg, {"model.safetensors": target, "mtp.safetensors": modules})
    return cfg, target, modules

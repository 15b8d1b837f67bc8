"""Write the trained model as a Hugging Face folder, and read it back.

- `model.safetensors`: the target, names exactly as `TargetModel.state_dict()` gives them
  (`lm_head.weight` omitted: it is tied to the embedding). transformers reads only this.
- `mtp.safetensors`: MTP module i as DeepSeek layer `model.layers.{N+i}.*`:
  enorm, hnorm, eh_proj, the block's weights directly under the layer prefix, and
  `shared_head.norm` (our `final_norm`). Embedding and head are shared with the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from chainspec.models.config import ModelConfig
from chainspec.training.demo_model import DemoModel

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_config(cfg: ModelConfig) -> dict:
    """config.json for LlamaForCausalLM, plus DeepSeek's MTP layer count."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope.theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0],
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": cfg.torch_dtype,
        "num_nextn_predict_layers": cfg.num_mtp_layers,
    }


def mtp_tensor_name(num_layers: int, index: int, local: str) -> str:
    """Our MTPModule parameter name -> its DeepSeek checkpoint name."""
    if local.startswith("block."):
        local = local[len("block."):]
    elif local.startswith("final_norm."):
        local = "shared_head.norm." + local[len("final_norm."):]
    return f"model.layers.{num_layers + index}.{local}"


def target_tensors(model: DemoModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = model.target.state_dict()
    state.pop("lm_head.weight")  # tied to model.embed_tokens.weight
    return {name: t.detach().to(dtype).contiguous() for name, t in state.items()}


def mtp_tensors(model: DemoModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    layers = model.config.num_layers
    return {mtp_tensor_name(layers, i, name): t.detach().to(dtype).contiguous()
            for i, module in enumerate(model.draft.mtp)
            for name, t in module.state_dict().items()}


def write_weights(model: DemoModel, out_dir: Path) -> None:
    cfg = model.config
    dtype = DTYPES[cfg.torch_dtype]
    meta = {"format": "pt"}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0],
                  "pad_token_id": cfg.eos_token_ids[0], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(target_tensors(model, dtype), str(out_dir / "model.safetensors"), meta)
    save_file(mtp_tensors(model, dtype), str(out_dir / "mtp.safetensors"), meta)


def load_model(model_dir: Path) -> DemoModel:
    """Read a written folder back into a float32 DemoModel (strict on every tensor)."""
    cfg = ModelConfig.from_dir(model_dir)
    model = DemoModel(cfg, cfg.num_mtp_layers)
    target = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    target["lm_head.weight"] = target["model.embed_tokens.weight"]
    model.target.load_state_dict(target, strict=True)
    stored = load_file(str(model_dir / "mtp.safetensors"))
    for i, module in enumerate(model.draft.mtp):
        names = {local: mtp_tensor_name(cfg.num_layers, i, local)
                 for local in module.state_dict()}
        module.load_state_dict({local: stored.pop(name).float()
                                for local, name in names.items()}, strict=True)
    if stored:
        raise ValueError(f"unexpected tensors in mtp.safetensors: {sorted(stored)[:5]}")
    return model.eval()

"""Checkpoints in the layouts people download, next to the transformers layouts the family
tests use:

- a Qwen3.5 release: `Qwen3_5ForConditionalGeneration.save_pretrained` (config with a
  nested `text_config`, tensors `model.language_model.*`, `lm_head.weight` and a tiny
  vision tower `model.visual.*`) plus the MTP layer `mtp.*` (vLLM's `qwen3_5_mtp.py`
  names); and the same weights in the `Qwen3_5ForCausalLM` layout, for comparison;
- a MiMo-V2-Flash config in the hub's original spelling (`hybrid_layer_pattern`,
  `moe_layer_freq`, `swa_*`, `sliding_window_size`, `layernorm_epsilon`, as SGLang's and
  vLLM's `mimo_v2_flash.py` read it), converted from transformers' spelling by hand here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from tests.unit.families import qwen3_5_checkpoint as qwen

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
              patch_size=2, spatial_merge_size=1, temporal_patch_size=1,
              num_position_embeddings=16)


def write_qwen3_5_release(path: Path, seed: int = 0, tie: bool = False
                          ) -> Qwen3_5ForConditionalGeneration:
    """A random release with one MTP layer; returns the transformers model (eval)."""
    text = {**qwen.SHAPE, "mtp_num_hidden_layers": 1, "tie_word_embeddings": tie}
    cfg = Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        qwen._randomise(dict(model.named_parameters()), torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    qwen.write_mtp(path, model.config.text_config, seed + 1)
    return model


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def write_as_causal_lm(release: Path, path: Path) -> None:
    """The release's text model and MTP layer in the `Qwen3_5ForCausalLM` layout."""
    config = json.loads((release / "config.json").read_text())
    text = {**config["text_config"], "architectures": ["Qwen3_5ForCausalLM"],
            "tie_word_embeddings": config["tie_word_embeddings"]}
    (path / "config.json").write_text(json.dumps(text))
    flat = {n.replace("model.language_model.", "model."): t
            for n, t in tensors_of(release).items() if not n.startswith("model.visual.")}
    save_file(flat, str(path / "model.safetensors"))


def mimo_hub_config(tf: dict[str, Any]) -> dict[str, Any]:
    """transformers' MiMo-V2-Flash config.json -> the hub's original spelling."""
    hub = {k: v for k, v in tf.items() if k not in (
        "layer_types", "mlp_layer_types", "rope_parameters", "rms_norm_eps", "sliding_window")}
    rope = tf["rope_parameters"]
    hub.update(
        hybrid_layer_pattern=[int(t == "sliding_attention") for t in tf["layer_types"]],
        moe_layer_freq=[int(t == "sparse") for t in tf["mlp_layer_types"]],
        swa_num_attention_heads=tf["num_attention_heads"],
        swa_num_key_value_heads=2 * tf["num_key_value_heads"],
        swa_head_dim=tf["head_dim"], swa_v_head_dim=tf["v_head_dim"],
        rope_theta=rope["full_attention"]["rope_theta"],
        swa_rope_theta=rope["sliding_attention"]["rope_theta"],
        partial_rotary_factor=rope["full_attention"]["partial_rotary_factor"],
        # the hub states both; the window is sliding_window_size keys before the row
        sliding_window=tf["sliding_window"] - 1, sliding_window_size=tf["sliding_window"] - 1,
        layernorm_epsilon=tf["rms_norm_eps"],
        add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        model_type="mimo_v2_flash",
    )
    return hub

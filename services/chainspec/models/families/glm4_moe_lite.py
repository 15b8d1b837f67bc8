"""The GLM-4.7-Flash family (`Glm4MoeLiteForCausalLM`): MLA attention + SwiGLU or MoE MLPs.

transformers' `glm4_moe_lite` is DeepSeek-V3's decoder under other names in code, the same
tensor names on disk: MLA (models/mla.py, q/kv low rank, interleaved RoPE, yarn's
`mscale_all_dim` squared in the softmax scale, latent norms at eps 1e-6) and per layer a
dense SwiGLU or the `moe` kind (sigmoid router with `e_score_correction_bias`,
`n_group`/`topk_group`, `routed_scaling_factor`, `n_shared_experts` shared experts,
`norm_topk_prob` default True). So this file reuses `families/deepseek_v3.py`'s config,
layers and MTP block, and differs in the layer pattern only:

- `mlp_layer_types` (per layer "dense" / "sparse"), transformers' default ["dense"] +
  ["sparse"] * (N - 1) when the config has none; `first_k_dense_replace` (which the hub
  config also carries, and vLLM reads) is ignored, as transformers ignores it.
- the rotary width is `qk_rope_head_dim` (transformers maps `head_dim` onto it); a
  `partial_rotary_factor` other than 1 would shrink it and is refused by name.

MTP glue (the NextN layer; vLLM's / SGLang's GLM-4.7-Flash MTP reads DeepSeek-V3's
layout, `adapters.DEEPSEEK`):

| what | GLM-4.7-Flash |
|---|---|
| where | `model.layers.{N+i}.*`, N = num_hidden_layers; `num_nextn_predict_layers` |
| glue | `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`; the layer's `embed_tokens` / |
| | `shared_head.head` copy the shared ones (ignored) |
| concat | [enorm(Emb(x[p+k])), hnorm(g[k-1][p])] |
| chain | yes: step k reads step k-1's block output (before `shared_head.norm`) |
| hidden read | the target's h after the final norm |
| token offset | step k at row p reads x[p+k] and predicts x[p+k+1] |
| layer kind | MLA + the last target layer's MLP kind (released: MoE, like vLLM's layer N) |
"""

from __future__ import annotations

from typing import Any

from chainspec.models.adapters import DEEPSEEK
from chainspec.models.errors import CheckpointError
from chainspec.models.families import deepseek_v3
from chainspec.models.families.base import Family


def mlp_layer_types(cfg: dict[str, Any], layers: int) -> list[str]:
    """The config's `mlp_layer_types`, or transformers' default (layer 0 dense)."""
    types = cfg.get("mlp_layer_types")
    return list(types) if types is not None else ["dense"] + ["sparse"] * (layers - 1)


def parse(cfg: dict[str, Any], arch: str) -> deepseek_v3.DeepseekV3Config:
    layers = int(cfg["num_hidden_layers"])
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise CheckpointError(f"{arch}: partial_rotary_factor={partial} is not supported (the "
                              f"rotary width is qk_rope_head_dim)")
    cfg = {**cfg, "mlp_layer_types": mlp_layer_types(cfg, layers)}
    cfg.pop("first_k_dense_replace", None)  # transformers' pattern is mlp_layer_types alone
    return deepseek_v3._parse(cfg, arch, *deepseek_v3.moe_layers(cfg, layers))


GLM4_MOE_LITE = Family(
    name="glm4_moe_lite",
    architectures=("Glm4MoeLiteForCausalLM",),
    parse=parse, build=deepseek_v3.build, mtp=DEEPSEEK, mtp_block=deepseek_v3.mtp_block,
    notes="MLA (latent paged cache) + dense SwiGLU / sigmoid-routed MoE by mlp_layer_types; "
          "NextN MTP at model.layers.{N+i} (MLA + MoE block), chained, reads h after "
          "the final norm",
)
FAMILIES = (GLM4_MOE_LITE,)

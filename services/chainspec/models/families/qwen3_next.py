"""The Qwen3-Next family (`Qwen3NextForCausalLM`, config model_type `qwen3_next`; e.g.
Qwen3-Next-80B-A3B): Qwen3.5's hybrid layers (`families/qwen3_5.py`) with fused GDN
projections and MoE MLPs. Tensor names are Hugging Face's, one to one.

Layer pattern: `layer_types` (default: three `linear_attention` then one `full_attention`,
`full_attention_interval` 4). Layer kinds:
- `linear` (`linear_attn.*`): Gated DeltaNet (`models/gated_deltanet.py`) whose input
  projections are fused and grouped by key head (`FusedGatedDeltaNet`, below);
- `full` (`self_attn.*`): GQA with an output gate, zero-centred q/k RMSNorm, partial RoPE;
- MLP: `models/moe.py` (softmax top-k, `norm_topk_prob` default True, a `shared_expert`
  gated by sigmoid(`shared_expert_gate`)) where `decoder_sparse_step` and `mlp_only_layers`
  say so, dense SwiGLU (`intermediate_size`) elsewhere.
Every RMSNorm but the GDN's gated one scales by (1 + w), as in Qwen3.5.

MTP glue (`mtp.*`, vLLM's `qwen3_next_mtp.py` layout; `adapters.QWEN3_NEXT`):

| | |
|---|---|
| tensors | `mtp.fc` (eh_proj), `mtp.pre_fc_norm_embedding` (enorm), |
| | `mtp.pre_fc_norm_hidden` (hnorm), `mtp.layers.{i}.*`, `mtp.norm` (final norm); |
| | embedding and head shared with the target |
| concat | [emb, hidden] |
| hidden read | h after the target's final norm (the exported h) |
| token offset | step k at row p reads x[p+k] |
| chain | one module reused for K steps (`mtp_num_hidden_layers` 1), chained through |
| | `mtp.norm` (vLLM's module returns the normed state; `MTPGlue.chains_normed`) |
| layer kind | one `full_attention` layer; its MLP MoE by the target's rule at index 0 |
| | (vLLM reads the index from `mtp.layers.0`): MoE unless `mlp_only_layers` has 0 |
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from chainspec.models.adapters import QWEN3_NEXT
from chainspec.models.errors import CheckpointError
from chainspec.models.families import qwen3_5
from chainspec.models.families.base import DecoderParts, Family
from chainspec.models.gated_deltanet import GatedDeltaNet
from chainspec.models.moe import MoEConfig, Scoring, sparse_layers


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's GDN: `in_proj_qkvz` [2 Dk Hk + 2 Dv Hv, H] and `in_proj_ba` [2 Hv, H],
    each laid out per key head g (transformers' `fix_query_key_value_ordering`):
        qkvz row block g = [q_g (Dk), k_g (Dk), v_g (r Dv), z_g (r Dv)],  r = Hv / Hk
        ba   row block g = [b_g (r), a_g (r)]
    so value head j belongs to key head j // r, as the unfused layout orders them."""

    def make_projections(self, hidden_size: int) -> None:
        s = self.shape
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * s.key_dim + 2 * s.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * s.num_v_heads, bias=False)

    def project(self, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        s, rows = self.shape, x.shape[0]
        r = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(rows, s.num_k_heads, -1)
        q, k, v, z = qkvz.split([s.k_head_dim, s.k_head_dim, r * s.v_head_dim,
                                 r * s.v_head_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(rows, s.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)],
                          dim=-1)  # [T, C]: the conv's channel order
        return (mixed, z.reshape(rows, s.num_v_heads, s.v_head_dim),
                b.reshape(rows, s.num_v_heads), a.reshape(rows, s.num_v_heads))


def parse(cfg: dict[str, Any], arch: str) -> qwen3_5.Qwen3_5Config:
    layers = int(cfg["num_hidden_layers"])
    if not cfg.get("num_experts"):
        return qwen3_5.parse_hybrid(cfg, arch)  # transformers builds dense MLPs then
    moe = MoEConfig.from_hf(cfg, Scoring.SOFTMAX, norm_default=True)
    if not moe.shared_intermediate_size:
        raise CheckpointError(f"{arch}: shared_expert_intermediate_size is 0; Qwen3-Next's "
                              f"MoE block always has its gated shared expert")
    # the MTP layer: the target's rule at layer index 0 (vLLM's reading of mtp.layers.0)
    sparse = sparse_layers(cfg, layers) + sparse_layers(cfg, 1)
    return replace(qwen3_5.parse_hybrid(cfg, arch), moe=moe, sparse=sparse)


def build(cfg: qwen3_5.Qwen3_5Config, cache_len: int | None) -> DecoderParts:
    return qwen3_5.build(cfg, cache_len, FusedGatedDeltaNet)


QWEN3_NEXT_FAMILY = Family(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    parse=parse, build=build, mtp=QWEN3_NEXT, mtp_block=qwen3_5.mtp_block,
    notes="Gated DeltaNet (fused in_proj_qkvz/in_proj_ba) + gated full attention (3:1), "
          "MoE (softmax top-k, gated shared expert); MTP at mtp.*, [emb, hidden], reads h "
          "after the final norm, one full-attention MoE layer",
)
FAMILIES = (QWEN3_NEXT_FAMILY,)

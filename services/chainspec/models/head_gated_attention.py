"""The `head_gated` attention kind (DESIGN 2.4; Step-3.5/3.7-Flash): the `sliding` kind
(`models/sliding_attention.py`: GQA, optional window, its own cache spec) with
- zero-centred q/k RMSNorm per head (scale by 1 + w), before RoPE;
- a sigmoid gate per query head from its own projection (`g_proj`, [H] -> [Hq]) that
  scales that head's attention output before `o_proj`;
- the scale `query_pre_attn_scalar ** -0.5` (default `head_dim ** -0.5`).

    out_h = sigmoid(g_proj(x))_h * attend(rope(q_norm(q_h)), rope(k_norm(k)), v)_h
"""

from __future__ import annotations

import torch
from torch import nn

from chainspec.models.layers import AttentionBackend, RMSNorm
from chainspec.models.rope import RotaryEmbedding
from chainspec.models.sliding_attention import AttentionShape, SlidingAttention


class HeadGatedAttention(SlidingAttention):
    """q/k/v/o/g projections and q/k norms (HF names), RoPE, attention via the backend."""

    def __init__(self, shape: AttentionShape, layer_id: int, rotary: RotaryEmbedding, *,
                 eps: float, scale: float, head_gate: bool = True) -> None:
        super().__init__(shape, layer_id, rotary)
        s = shape
        if s.bias:  # NOTE: this family's o_proj carries the attention bias too
            self.o_proj = nn.Linear(s.num_heads * s.v_head_dim, s.hidden_size, bias=True)
        self.q_norm = RMSNorm(s.head_dim, eps, unit_offset=True)
        self.k_norm = RMSNorm(s.head_dim, eps, unit_offset=True)
        self.head_gate = head_gate
        if head_gate:
            self.g_proj = nn.Linear(s.hidden_size, s.num_heads, bias=False)
        self.scale = scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        s, rows = self.shape, x.shape[0]
        q = self.q_norm(self.q_proj(x).view(rows, s.num_heads, s.head_dim))  # [T, Hq, D]
        k = self.k_norm(self.k_proj(x).view(rows, s.num_kv_heads, s.head_dim))  # [T, Hkv, D]
        v = self.v_proj(x).view(rows, s.num_kv_heads, s.v_head_dim)  # [T, Hkv, Dv]
        q, k = self.rotary[0](q, k, positions)
        out = backend.attend(self.layer_id, q, k, v, scale=self.scale, window=s.window)
        if self.head_gate:
            out = out * torch.sigmoid(self.g_proj(x))[..., None]  # [T, Hq, Dv] * [T, Hq, 1]
        return self.o_proj(out.reshape(rows, -1))

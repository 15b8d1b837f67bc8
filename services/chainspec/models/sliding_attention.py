"""The `sliding` attention kind (DESIGN 2.4): GQA over a sliding window with attention
sinks, keys and values of their own widths, and a value scale (MiMo-V2-Flash; the same
shape serves its global layers with no window and no sinks).

A row at position p sees keys p-window+1..p (`PagedSpec.window`: blocks below it go
back to the pool). `attention_sink_bias` [Hq] is one more logit per head in the softmax
denominator that adds no value. Values are scaled by `value_scale` before they are
cached, as the checkpoints were trained. RoPE may be partial (the rotary table's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from chainspec.models.cache_spec import CacheSpec, PagedSpec
from chainspec.models.layers import AttentionBackend
from chainspec.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class AttentionShape:
    """One attention kind's shape and options."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key width per head
    v_head_dim: int  # value width per head
    window: int | None = None  # sliding window W (None: full length)
    sinks: bool = False  # a learned sink logit per query head
    value_scale: float = 1.0
    bias: bool = False  # q/k/v projections

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads do not group over "
                             f"{self.num_kv_heads} kv heads")


class SlidingAttention(nn.Module):
    """q/k/v/o projections (HF names), RoPE, attention through the backend."""

    def __init__(self, shape: AttentionShape, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        s, h = shape, shape.hidden_size
        self.shape = shape
        self.layer_id = layer_id
        self.q_proj = nn.Linear(h, s.num_heads * s.head_dim, bias=s.bias)
        self.k_proj = nn.Linear(h, s.num_kv_heads * s.head_dim, bias=s.bias)
        self.v_proj = nn.Linear(h, s.num_kv_heads * s.v_head_dim, bias=s.bias)
        self.o_proj = nn.Linear(s.num_heads * s.v_head_dim, h, bias=False)
        if s.sinks:
            self.attention_sink_bias = nn.Parameter(torch.zeros(s.num_heads))
        self.rotary = [rotary]  # a list: shared, not registered as this layer's submodule
        self.scale = s.head_dim ** -0.5

    def cache_spec(self) -> CacheSpec:
        s = self.shape
        return PagedSpec(s.num_kv_heads, s.head_dim, s.v_head_dim, s.window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        s, rows = self.shape, x.shape[0]
        q = self.q_proj(x).view(rows, s.num_heads, s.head_dim)  # [T, Hq, Dk]
        k = self.k_proj(x).view(rows, s.num_kv_heads, s.head_dim)  # [T, Hkv, Dk]
        v = self.v_proj(x).view(rows, s.num_kv_heads, s.v_head_dim)  # [T, Hkv, Dv]
        if s.value_scale != 1.0:
            v = v * s.value_scale
        q, k = self.rotary[0](q, k, positions)
        out = backend.attend(self.layer_id, q, k, v, scale=self.scale, window=s.window,
                             sinks=self.attention_sink_bias if s.sinks else None)
        return self.o_proj(out.reshape(rows, -1))  # out [T, Hq, Dv]

"""Decoder building blocks of the Llama family, over packed rows `[T, hidden]`.

Parameter names follow Hugging Face checkpoints (`self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, ...) so state dicts map one to one.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from chainspec.models.cache_spec import CacheSpec, PagedSpec
from chainspec.models.config import ModelConfig
from chainspec.models.recurrent import RecurrentAccess
from chainspec.models.rope import RotaryEmbedding


class AttentionBackend(Protocol):
    """What layers call for this step's attention and states (`models/attention.py`)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               *, scale: float | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None, value_dim: int | None = None
               ) -> torch.Tensor:
        """q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] (None: latent, values are k's
        first `value_dim` channels) -> [T, Hq, Dv]; keys stored for later steps."""

    def recurrent(self, layer: int) -> RecurrentAccess:
        """A linear-attention layer's view of its sequences' states."""


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. `unit_offset` scales by (1 + weight) (Qwen3-Next style)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x if dtype == torch.float32 else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (self.weight.float() + 1.0)).to(dtype)
        return self.weight * (x32 if dtype == torch.float32 else x32.to(dtype))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Grouped-query attention with RoPE and optional q/k RMSNorm (Qwen3).

    `output_gate` (Qwen3.5, Qwen3-Next): q_proj is twice as wide, [q_h, gate_h] per head,
    and the attention output is scaled by sigmoid(gate) before o_proj.
    `unit_offset_norms`: the q/k norms scale by (1 + w) (zero-centred weights)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, *,
                 output_gate: bool = False, unit_offset_norms: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.output_gate = output_gate
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size * (2 if output_gate else 1),
                                bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, unit_offset_norms)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, unit_offset_norms)
        self.qk_norm = cfg.qk_norm
        self.rotary = [rotary]  # a list: shared, not registered as this layer's submodule
        self.scale = cfg.head_dim ** -0.5

    def cache_spec(self) -> CacheSpec:
        return PagedSpec(self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, self.num_heads, -1)  # [T, Hq, D] (gated: 2D)
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)  # [T, Hq, D] each
        k = self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](q, k, positions)
        out = backend.attend(self.layer_id, q, k, v, scale=self.scale)  # [T, Hq, D]
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(rows, -1))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block. `layer_id` indexes its KV cache layer; `mlp`: the
    MLP kind (default: dense SwiGLU; `models/moe.py` SparseMoE for MoE layers)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, rotary)
        self.mlp = mlp if mlp is not None else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def cache_spec(self) -> CacheSpec:
        return self.self_attn.cache_spec()

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

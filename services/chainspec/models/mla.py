"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash), the `mla` layer kind.

Per row: q = q_b(norm(q_a(x))) (or q_proj(x) without a q rank) split into q_nope [Dn] and
q_rope [Dr] per head; kv_a_proj_with_mqa(x) gives the latent c_kv [r] (normed) and one
k_rope [Dr] shared by every head. kv_b_proj expands c_kv to per-head k_nope [Dn] and v
[Dv]. The cache holds only c_kv and k_rope: one latent head of r + Dr channels per
position, its first r channels serving as the values (`PagedSpec(latent=True)`).

Every backend runs the **absorbed** form: kv_b's K part folds into the query
(q_latent = W_k^T q_nope, [r] per head), so all Hq heads attend over the one latent head
with keys [c_kv, k_rope] and values c_kv; kv_b's V part then maps each head's [r] output
to [Dv]. Scores and outputs equal the expanded form's (`expanded`, the unit tests'
oracle), which would need per-head K/V of every cached position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from chainspec.models.cache_spec import CacheSpec, PagedSpec
from chainspec.models.layers import AttentionBackend, RMSNorm
from chainspec.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class MLAShape:
    """What an MLA layer needs from its family's config."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: one q_proj, no low-rank query
    kv_lora_rank: int  # r: latent width
    qk_nope_head_dim: int  # Dn
    qk_rope_head_dim: int  # Dr
    v_head_dim: int  # Dv
    scale: float  # softmax scale (DeepSeek: (Dn + Dr)^-0.5, times yarn's mscale^2)
    rope_interleave: bool = True  # rotary pairs (0, 1), (2, 3), ... (DeepSeek's layout)
    bias: bool = False  # attention_bias: q_a / kv_a / o_proj biases
    latent_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm epsilon


class LatentAttention(nn.Module):
    """MLA over packed rows `[T, hidden]`; HF parameter names (`self_attn.*`)."""

    def __init__(self, shape: MLAShape, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        s = self.shape = shape
        self.layer_id = layer_id
        h, heads, qk = s.hidden_size, s.num_heads, s.qk_nope_head_dim + s.qk_rope_head_dim
        if s.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, s.q_lora_rank, bias=s.bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.latent_eps)
            self.q_b_proj = nn.Linear(s.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, s.kv_lora_rank + s.qk_rope_head_dim, bias=s.bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.latent_eps)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, heads * (s.qk_nope_head_dim + s.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(heads * s.v_head_dim, h, bias=s.bias)
        self.rotary = [rotary]  # a list: shared, not registered as this layer's submodule

    def cache_spec(self) -> CacheSpec:
        r, dr = self.shape.kv_lora_rank, self.shape.qk_rope_head_dim
        return PagedSpec(num_kv_heads=1, head_dim=r + dr, v_head_dim=r, latent=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """The absorbed form: Hq query heads over one latent head of r + Dr channels."""
        s, rows = self.shape, x.shape[0]
        q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
        w_k, w_v = self._kv_b_parts()  # [H, Dn, r], [H, Dv, r]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_k)  # [T, H, r]
        q = torch.cat([q_latent, q_rope], dim=-1)  # [T, H, r + Dr]
        k = torch.cat([c_kv, k_rope], dim=-1)[:, None]  # [T, 1, r + Dr]
        out = backend.attend(self.layer_id, q, k, None, scale=s.scale,
                             value_dim=s.kv_lora_rank)  # [T, H, r]
        out = torch.einsum("thr,hvr->thv", out, w_v)  # [T, H, Dv]
        return self.o_proj(out.reshape(rows, -1))

    def expanded(self, x: torch.Tensor, positions: torch.Tensor,
                 backend: AttentionBackend) -> torch.Tensor:
        """The textbook form (per-head K/V from kv_b_proj): the absorbed form's oracle.
        NOTE: needs a backend that takes full K/V (DenseCausal); never cached paged."""
        s, rows = self.shape, x.shape[0]
        q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
        kv = self.kv_b_proj(c_kv).view(rows, s.num_heads, -1)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, s.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [T, H, Dn + Dr]
        out = backend.attend(self.layer_id, q, k, v, scale=s.scale)  # [T, H, Dv]
        return self.o_proj(out.reshape(rows, -1))

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q_nope [T, H, Dn], q_rope [T, H, Dr] (rotated), c_kv [T, r], k_rope [T, Dr]."""
        s, rows = self.shape, x.shape[0]
        if s.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(rows, s.num_heads, -1).split(
            [s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim],
                                                        dim=-1)
        if s.rope_interleave:  # pairs (2i, 2i+1) -> (i, i + Dr/2): rotate-half's layout
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope, k_rope = self.rotary[0](q_rope, k_rope[:, None], positions)
        return q_nope, q_rope, self.kv_a_layernorm(c_kv), k_rope[:, 0]

    def _kv_b_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        w = self.kv_b_proj.weight.view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim,
                                       s.kv_lora_rank)
        return w.split([s.qk_nope_head_dim, s.v_head_dim], dim=1)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    # NOTE: applied to q and k alike, so their dot products are those of the interleaved
    # rotation; k_rope is cached in this layout.
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentDecoderLayer(nn.Module):
    """Pre-norm MLA + an MLP kind (dense SwiGLU for DeepSeek's dense layers; a family
    passes its MoE)."""

    def __init__(self, shape: MLAShape, rms_eps: float, layer_id: int,
                 rotary: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = LatentAttention(shape, layer_id, rotary)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(shape.hidden_size, rms_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, rms_eps)

    @property
    def layer_id(self) -> int:
        return self.self_attn.layer_id

    def cache_spec(self) -> CacheSpec:
        return self.self_attn.cache_spec()

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

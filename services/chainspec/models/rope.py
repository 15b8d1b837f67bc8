"""Rotary position embeddings with the usual scaling variants.

Frequencies follow the Hugging Face definitions so that checkpoints trained with them
load unchanged: default, linear, dynamic (NTK; within the trained context it equals
default, beyond it the base is rescaled for the cache's maximum length), llama3, yarn.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from chainspec.models.config import RopeConfig


def _default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    old_len = cfg.original_max_position or 8192
    low_wavelen = old_len / cfg.low_freq_factor
    high_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor
                                                          - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, cfg: RopeConfig, max_position: int) -> tuple[torch.Tensor, float]:
    old_len = cfg.original_max_position or max_position
    factor = cfg.factor
    mscale = cfg.attention_factor
    if mscale is None:
        mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(cfg.theta))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation_weight = 1 - ramp.clamp(0, 1)
    pos_freqs = cfg.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(mscale)


def rope_frequencies(cfg: RopeConfig, head_dim: int, max_position: int,
                     cache_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim/2] and the attention scaling applied to cos/sin."""
    dim = int(head_dim * cfg.partial_rotary_factor)
    if cfg.type == "yarn":
        return _yarn_inv_freq(dim, cfg, max_position)
    theta = cfg.theta
    if cfg.type == "dynamic" and cache_len > max_position:
        theta = theta * ((cfg.factor * cache_len / max_position) - (cfg.factor - 1)) ** (
            dim / (dim - 2))
    inv_freq = _default_inv_freq(dim, theta)
    if cfg.type == "linear":
        inv_freq = inv_freq / cfg.factor
    elif cfg.type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, cfg)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Applies RoPE to packed rows given each row's position."""

    def __init__(self, cfg: RopeConfig, head_dim: int, max_position: int,
                 cache_len: int | None = None) -> None:
        super().__init__()
        cache_len = cache_len or max_position
        inv_freq, scale = rope_frequencies(cfg, head_dim, max_position, cache_len)
        self.rot_dim = inv_freq.numel() * 2
        self.scale = scale
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # NOTE: cos/sin of every position are tabulated once (fp32, the same products HF
        # computes per call), so a layer only gathers its rows.
        freqs = torch.arange(max(cache_len, max_position)).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [positions, rot_dim]
        self.register_buffer("cos_table", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_table", emb.sin() * scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, rot_dim]
        return self.cos_table[positions].to(dtype), self.sin_table[positions].to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, Hq, D], k [T, Hkv, D]
        cos, sin = self.cos_sin(positions, q.dtype)
        return _apply(q, cos, sin, self.rot_dim), _apply(k, cos, sin, self.rot_dim)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    rot, passthrough = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, passthrough), dim=-1) if passthrough.numel() else out

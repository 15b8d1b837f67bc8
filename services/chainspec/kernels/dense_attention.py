"""Dense causal attention over `[B, H, T, D]` blocks, with the layer kinds' options:
a sliding window and attention sinks (DESIGN 2.4). The training path and the oracle of
the paged kernels; plain causal attention without options goes through SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: int | None = None, sinks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """q [B, Hq, T, Dk], k [B, Hkv, T, Dk], v [B, Hkv, T, Dv] -> [B, Hq, T, Dv].

    Row t sees keys t-window+1..t (all of 0..t without a window). `sinks` [Hq]: a logit
    per head that joins the softmax's denominator and adds nothing to the output."""
    if window is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=True)
    t = q.shape[2]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, Hq, T, T]
    pos = torch.arange(t, device=q.device)
    hidden = pos[None, :] > pos[:, None]  # [T, T]: key after the row
    if window is not None:
        hidden = hidden | (pos[None, :] <= pos[:, None] - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.matmul(probs, v.float()).to(q.dtype)

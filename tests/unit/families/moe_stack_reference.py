"""The GLM-4.5 / Qwen3-MoE decoder layer and MTP equations written plainly from checkpoint
tensors (hub names, experts per expert), nothing from chainspec's layers: the oracle of
the MTP drafter (DESIGN 2.4).

    block(x)  = x' + MLP(post_norm(x')),  x' = x + o_proj(attn(q, k, v)),  n = in_norm(x)
    q, k      = rope_half(qk_norm(q_proj n)), rope_half(qk_norm(k_proj n)), partial rotary
    MoE(n)    = sum_j w_j SwiGLU_{e_j}(n) (+ shared SwiGLU(n))
    sigmoid:  s = sigmoid(n G^T); choose top-k of s + b among the topk_group groups whose
              two best s + b sum highest; w = s_e / sum s_e * routed_scaling_factor
    softmax:  p = softmax(n G^T); top-k of p; w = p_e (/ sum p_e with norm_topk_prob)
    MTP k:    g_k = block(eh_proj [enorm(E x[p+k]), hnorm(g_{k-1})]), logits = head(norm g_k)
"""

from __future__ import annotations

import torch


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def linear(t, name, x):
    bias = t.get(name + ".bias")
    return x @ t[name + ".weight"].T + (0 if bias is None else bias)


def rope_half(x, positions, theta, rot_dim):
    """x [T, heads, D]: pairs (j, j + rot_dim/2) of the first rot_dim channels turn."""
    half = rot_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rot_dim)
    angle = (positions[:, None].double() * freqs[None, :]).float()[:, None, :]
    a, b, rest = x[..., :half], x[..., half:rot_dim], x[..., rot_dim:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin(),
                      rest], dim=-1)


def attention(t, a, cfg, x, positions):
    d, eps = cfg.head_dim, cfg.rms_norm_eps
    q, k, v = (linear(t, a + f"{w}_proj", x).view(len(x), -1, d) for w in "qkv")
    if a + "q_norm.weight" in t:
        q, k = rms(q, t[a + "q_norm.weight"], eps), rms(k, t[a + "k_norm.weight"], eps)
    rope = cfg.rope_parameters
    rot = int(d * rope.get("partial_rotary_factor", 1.0))
    q, k = (rope_half(z, positions, rope["rope_theta"], rot) for z in (q, k))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / d ** 0.5
    future = torch.ones(len(x), len(x), dtype=torch.bool).triu(1)
    o = torch.einsum("hts,shd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), v)
    return linear(t, a + "o_proj", o.reshape(len(x), -1))


def swiglu(t, p, x):
    gate, up = linear(t, p + "gate_proj", x), linear(t, p + "up_proj", x)
    return linear(t, p + "down_proj", gate * torch.sigmoid(gate) * up)


def route(t, m, cfg, x):
    """-> (ids [T, k], weights [T, k]) per row, as the equations above say."""
    k = cfg.num_experts_per_tok
    logits = x @ t[m + "gate.weight"].T  # [T, E]
    if m + "gate.e_score_correction_bias" not in t:  # softmax (Qwen3-MoE)
        probs = logits.softmax(-1)
        w, ids = probs.sort(-1, descending=True)
        w, ids = w[:, :k], ids[:, :k]
        return ids, w / w.sum(-1, keepdim=True) if cfg.norm_topk_prob else w
    s = torch.sigmoid(logits)
    choice = s + t[m + "gate.e_score_correction_bias"]
    groups = choice.view(len(x), cfg.n_group, -1)
    group_score = groups.sort(-1, descending=True)[0][..., :2].sum(-1)  # [T, G]
    kept = group_score.sort(-1, descending=True)[1][:, :cfg.topk_group]
    mask = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, kept, True)
    choice = torch.where(mask[..., None], groups, float("-inf")).view(len(x), -1)
    ids = choice.sort(-1, descending=True)[1][:, :k]
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) if cfg.norm_topk_prob else w
    return ids, w * cfg.routed_scaling_factor


def moe(t, m, cfg, x):
    ids, weights = route(t, m, cfg, x)
    out = torch.zeros_like(x)
    for row in range(len(x)):
        for e, w in zip(ids[row].tolist(), weights[row], strict=True):
            out[row] += w * swiglu(t, m + f"experts.{e}.", x[row:row + 1])[0]
    if m + "shared_experts.gate_proj.weight" in t:
        out = out + swiglu(t, m + "shared_experts.", x)
    return out


def block(t, p, cfg, x, positions):
    eps = cfg.rms_norm_eps
    x = x + attention(t, p + "self_attn.", cfg, rms(x, t[p + "input_layernorm.weight"], eps),
                      positions)
    n = rms(x, t[p + "post_attention_layernorm.weight"], eps)
    m = p + "mlp."
    return x + (moe(t, m, cfg, n) if m + "gate.weight" in t else swiglu(t, m, n))


def reference_steps(t, cfg, x, h, prefix, num_modules, num_steps):
    """Chain mode, g[0] = h: [(g_k, logits_k)] for k = 1..num_steps. prefix(i): module
    i's layer prefix."""
    eps, positions, prev, out = cfg.rms_norm_eps, torch.arange(len(h)), h, []
    for k in range(1, num_steps + 1):
        p = prefix((k - 1) % num_modules)
        e = rms(t["model.embed_tokens.weight"][x[k: k + len(h)]], t[p + "enorm.weight"], eps)
        u = torch.cat([e, rms(prev, t[p + "hnorm.weight"], eps)], -1)
        g = block(t, p, cfg, u @ t[p + "eh_proj.weight"].T, positions)
        out.append((g, rms(g, t[p + "shared_head.norm.weight"], eps) @ t["lm_head.weight"].T))
        prev = g
    return out

"""Golden tests of the MTP family adapters (DESIGN 2.2).

For each family a random checkpoint is written in that family's naming, loaded strictly,
and every draft step is compared with a plainly written reference of the equations
below, computed straight from the checkpoint tensors (its own RMSNorm, RoPE, causal
attention and SwiGLU; nothing from chainspec's layers):

    u       = concat(enorm(Emb(x[p+k])), hnorm(g[k-1][p]))   # [hidden, emb] for MiMo
    g[k][p] = Block_m(eh_proj(u)),  m = (k-1) mod L
    logits  = LMHead(final_norm_m(g[k][p]))
with g[0] = h, and g[k-1] replaced by h in non-chain mode. DeepSeek-V3's MTP layers (an MLA
block) have their own golden test in tests/unit/families/test_deepseek_v3.py, Qwen3-Next's
(a gated full-attention MoE block) in tests/unit/families/test_qwen3_next_mtp.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_draft_model
from tests.unit.checkpoints import (
    FAMILY_GLUE,
    hf_config,
    mtp_prefix,
    mtp_shapes,
    random_tensors,
    target_shapes,
    write_checkpoint,
)

MODULES = 3  # modules written to every checkpoint
SEQ = 10  # rows per sequence
BLOCK = 4  # KV block size of the paged-chunk test
TABLES = {0: [4, 1, 3], 1: [0, 5, 2]}  # interleaved, out of order: mix-ups show


@dataclass(frozen=True)
class Family:
    arch: str
    naming: str
    hidden_first: bool = False
    zero_centred: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    with_target: bool = False  # the checkpoint also holds the target's layers
    shared_copies: bool = False  # DeepSeek's per-layer embed_tokens / shared_head.head
    config: dict = field(default_factory=dict)


FAMILIES = {
    "llama_demo": Family("LlamaForCausalLM", "deepseek", with_target=True,
                         config={"num_nextn_predict_layers": MODULES}),
    "glm4_moe": Family("Glm4MoeForCausalLM", "deepseek", qkv_bias=True, qk_norm=True,
                       config={"num_nextn_predict_layers": MODULES, "attention_bias": True,
                               "use_qk_norm": True, "partial_rotary_factor": 0.5}),
    "mimo": Family("MiMoForCausalLM", "mimo", hidden_first=True, qkv_bias=True,
                   config={"num_nextn_predict_layers": MODULES}),
}


def write_family(tmp_path, fam: Family, tied: bool = False) -> tuple[dict, dict]:
    cfg = hf_config(fam.arch, tie_word_embeddings=tied, **fam.config)
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], cfg["hidden_size"])}
    if not tied:
        shapes["lm_head.weight"] = (cfg["vocab_size"], cfg["hidden_size"])
    shapes.update(mtp_shapes(fam.naming, cfg, MODULES, fam.qkv_bias, fam.qk_norm))
    if fam.shared_copies:
        for i in range(MODULES):
            p = mtp_prefix(fam.naming, i, cfg)
            shapes[p + "embed_tokens.weight"] = shapes["model.embed_tokens.weight"]
            shapes[p + "shared_head.head.weight"] = shapes["model.embed_tokens.weight"]
    tensors = random_tensors(shapes, seed=7, zero_centred_norms=fam.zero_centred)
    files = {"model.safetensors": tensors}
    if fam.with_target:
        target = random_tensors(target_shapes(cfg, fam.qkv_bias, fam.qk_norm), seed=8)
        target.update({k: tensors[k] for k in shapes if not mtp_owned(k, fam, cfg)})
        files = {"model.safetensors": target,
                 "mtp.safetensors": {k: v for k, v in tensors.items() if k not in target}}
    write_checkpoint(tmp_path, cfg, files)
    return cfg, tensors


def mtp_owned(name: str, fam: Family, cfg: dict) -> bool:
    return any(name.startswith(mtp_prefix(fam.naming, i, cfg)) for i in range(MODULES))


# --- the reference, written plainly -------------------------------------------------------

def rms_norm(x, w, eps, zero_centred):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if zero_centred else y * w


def rope(x, positions, theta, rot_dim):
    # x [T, heads, D]: pairs (j, j + rot_dim/2) of the first rot_dim dims turn by pos * f_j
    half = rot_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rot_dim)
    angle = (positions[:, None].double() * freqs[None, :]).float()[:, None, :]  # [T, 1, half]
    a, b, rest = x[..., :half], x[..., half:rot_dim], x[..., rot_dim:]
    return torch.cat([a * angle.cos() - b * angle.sin(),
                      b * angle.cos() + a * angle.sin(), rest], dim=-1)


def causal_attention(q, k, v):
    # q [T, Hq, D], k/v [T, Hkv, D]; every query head group shares one KV head
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    future = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", weights, v)


def linear(t, prefix, x):
    bias = t.get(prefix + ".bias")
    return x @ t[prefix + ".weight"].T + (0 if bias is None else bias)


def block(t, p, cfg, fam, x, positions):
    eps, d = cfg["rms_norm_eps"], cfg["head_dim"]
    rot_dim = int(d * cfg.get("partial_rotary_factor", 1.0))
    n = rms_norm(x, t[p + "input_layernorm.weight"], eps, fam.zero_centred)
    q, k, v = (linear(t, p + f"self_attn.{w}_proj", n).view(len(x), -1, d) for w in "qkv")
    if fam.qk_norm:
        q = rms_norm(q, t[p + "self_attn.q_norm.weight"], eps, fam.zero_centred)
        k = rms_norm(k, t[p + "self_attn.k_norm.weight"], eps, fam.zero_centred)
    q, k = rope(q, positions, cfg["rope_theta"], rot_dim), rope(k, positions, cfg["rope_theta"],
                                                                rot_dim)
    x = x + linear(t, p + "self_attn.o_proj", causal_attention(q, k, v).reshape(len(x), -1))
    n = rms_norm(x, t[p + "post_attention_layernorm.weight"], eps, fam.zero_centred)
    gate, up = linear(t, p + "mlp.gate_proj", n), linear(t, p + "mlp.up_proj", n)
    return x + linear(t, p + "mlp.down_proj", gate * torch.sigmoid(gate) * up)


def glue(t, fam, cfg, module):
    p = mtp_prefix(fam.naming, module, cfg)
    return p, {part: t[name.format(p=p)] for part, name in FAMILY_GLUE[fam.naming].items()}


def reference_steps(t, fam, cfg, x, h, num_modules, num_steps, chain):
    """x [SEQ + K] tokens, h [SEQ, H] -> [(g_k, logits_k) for k = 1..K] over all rows."""
    eps, positions = cfg["rms_norm_eps"], torch.arange(len(h))
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    prev, out = h, []
    for k in range(1, num_steps + 1):
        p, w = glue(t, fam, cfg, (k - 1) % num_modules)
        e = rms_norm(t["model.embed_tokens.weight"][x[k: k + len(h)]], w["enorm"], eps,
                     fam.zero_centred)
        g = rms_norm(prev, w["hnorm"], eps, fam.zero_centred)
        u = torch.cat([g, e] if fam.hidden_first else [e, g], dim=-1)
        g_k = block(t, p, cfg, fam, u @ w["eh_proj"].T, positions)
        out.append((g_k, rms_norm(g_k, w["final_norm"], eps, fam.zero_centred) @ head.T))
        prev = g_k if chain else h
    return out


# --- chainspec's side ---------------------------------------------------------------------

def chainspec_steps(model, x, h, num_steps, chain, backend):
    prev, out = h, []
    for k in range(1, num_steps + 1):
        g = model.step(k, x[k: k + len(h)], prev, torch.arange(len(h)), backend)
        out.append((g, model.logits(k, g)))
        prev = g if chain else h
    return out


def inputs(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg["vocab_size"], (SEQ + MODULES + 1,), generator=gen)
    return x, torch.randn(SEQ, cfg["hidden_size"], generator=gen)


def assert_steps_equal(ours, ref):
    for k, ((g, logits), (g_ref, logits_ref)) in enumerate(zip(ours, ref, strict=True), 1):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4, msg=f"g at step {k}")
        torch.testing.assert_close(logits, logits_ref, atol=2e-5, rtol=1e-4,
                                   msg=f"logits at step {k}")


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "nonchain"])
@pytest.mark.parametrize("modules,steps", [(1, 3), (2, 3), (3, 3)])
@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_family_matches_reference_dense(tmp_path, name, modules, steps, chain):
    fam = FAMILIES[name]
    cfg, tensors = write_family(tmp_path, fam)
    model = load_draft_model(tmp_path, num_modules=modules)  # strict: no missing/unexpected
    assert model.num_modules == modules
    x, h = inputs(cfg)
    backend = DenseCausal(1, SEQ, model.config.head_dim ** -0.5)
    assert_steps_equal(chainspec_steps(model, x, h, steps, chain, backend),
                       reference_steps(tensors, fam, cfg, x, h, modules, steps, chain))


def run_chunk(model, cache, seqs, chunk, steps):
    """One packed forward per draft step over rows [lo, hi) of each slot's sequence.
    seqs {slot: (x, h)}, chunk {slot: (lo, hi)} -> {slot: [g_k rows for k = 1..K]}."""
    batch = AttnBatch.build([SeqRows(TABLES[slot], lo, hi - lo) for slot, (lo, hi) in
                             chunk.items()], BLOCK)
    backend = PagedAttention(cache, batch, model.config.head_dim ** -0.5)
    prev = torch.cat([seqs[slot][1][lo:hi] for slot, (lo, hi) in chunk.items()])
    sizes = [hi - lo for lo, hi in chunk.values()]
    out = {slot: [] for slot in chunk}
    for k in range(1, steps + 1):
        tokens = torch.cat([seqs[slot][0][lo + k: hi + k] for slot, (lo, hi) in chunk.items()])
        prev = model.step(k, tokens, prev, batch.positions, backend)  # chain mode
        for slot, part in zip(chunk, prev.split(sizes), strict=True):
            out[slot].append(part)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_family_matches_reference_paged_chunks(tmp_path, name):
    """Two sequences packed together, each fed in two chunks through the KV cache."""
    fam = FAMILIES[name]
    cfg, tensors = write_family(tmp_path, fam, tied=True)
    model, steps = load_draft_model(tmp_path, num_modules=2), 3
    seqs = {1: inputs(cfg, 1), 0: inputs(cfg, 2)}  # slot -> (x, h)
    chunks = [{1: (0, 4), 0: (0, 7)}, {1: (4, SEQ), 0: (7, SEQ)}]  # slot -> rows [lo, hi)
    cache = ModelKVCache.uniform(steps, 6, BLOCK, model.config.num_kv_heads, model.config.head_dim)
    got = {slot: [[] for _ in range(steps)] for slot in seqs}
    for chunk in chunks:
        for slot, per_step in run_chunk(model, cache, seqs, chunk, steps).items():
            for k, g in enumerate(per_step):
                got[slot][k].append(g)
    for slot, (x, h) in seqs.items():
        gs = [torch.cat(parts) for parts in got[slot]]
        ours = [(g, model.logits(k, g)) for k, g in enumerate(gs, 1)]
        assert_steps_equal(ours, reference_steps(tensors, fam, cfg, x, h, 2, steps, True))


@torch.no_grad()
def test_chain_and_non_chain_differ_at_step_two(tmp_path):
    fam = FAMILIES["llama_demo"]
    cfg, _ = write_family(tmp_path, fam)
    model = load_draft_model(tmp_path)
    x, h = inputs(cfg)
    backend = DenseCausal(1, SEQ, model.config.head_dim ** -0.5)
    chained = chainspec_steps(model, x, h, 2, True, backend)
    plain = chainspec_steps(model, x, h, 2, False, backend)
    torch.testing.assert_close(chained[0][0], plain[0][0])  # step 1 reads h in both modes
    assert (chained[1][0] - plain[1][0]).abs().max() > 1e-2


@torch.no_grad()
def test_module_reuse_differs_from_distinct_modules(tmp_path):
    """L=1 reuses module 0 at step 2; L=2 uses module 1 there: outputs must differ."""
    fam = FAMILIES["mimo"]
    cfg, _ = write_family(tmp_path, fam)
    x, h = inputs(cfg)
    one, two = load_draft_model(tmp_path, num_modules=1), load_draft_model(tmp_path,
                                                                           num_modules=2)
    backend = DenseCausal(1, SEQ, one.config.head_dim ** -0.5)
    reuse, distinct = (chainspec_steps(m, x, h, 2, True, backend) for m in (one, two))
    torch.testing.assert_close(reuse[0][0], distinct[0][0])
    assert (reuse[1][0] - distinct[1][0]).abs().max() > 1e-2

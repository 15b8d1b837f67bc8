"""MiMo-V2-Flash through the verifier engine (prefill chunks of 5, blocks of 4, window 8):
greedy plain decoding equals transformers' own cached greedy decoding on prompts and
outputs that run past the window; windowed layers hold at most ceil((W+K)/block)+1
blocks per sequence after every step while the output stays that of a model that frees
nothing (DenseCausal over the whole prefix); the three MTP layers (hub layout, non-chain,
h before the final norm) load strictly, equal a from-scratch reference of their
equations, and speculative output equals plain at K = 1..4, batch 1/3/8."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DynamicCache

from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.request import StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.models.attention import DenseCausal
from chainspec.models.errors import CheckpointError
from chainspec.models.loader import load_draft_model, load_target
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families.mimo_v2_flash_checkpoint import (
    NUM_MTP,
    WINDOW,
    write_checkpoint,
    write_mtp,
    write_target,
)

BLOCKS = KVBudget(block_size=4)
CHUNK = 5
MAX_TOKENS = 14
VOCAB = 24  # small: drafts of random modules sometimes hit


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 17, 4, 12, 6, 21, 8][:n]  # + 14 tokens: all but one pass the window
    return [torch.randint(0, VOCAB, (m,), generator=gen).tolist() for m in lengths]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_v2_flash_engine")
    hf = write_checkpoint(path, seed=5, vocab_size=VOCAB)
    return hf, load_target(path), load_draft_model(path), path


@pytest.fixture(scope="module")
def plain(models):
    _, target, _, _ = models
    return outputs(engine(target, chunk=CHUNK, kv=BLOCKS), prompts(8), MAX_TOKENS)[0]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own cached greedy decoding (its sliding-window cache layers)."""
    cache = DynamicCache(config=hf.config)
    logits = hf(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = hf(input_ids=torch.tensor([out[-1:]]), cache=cache, use_cache=True).logits
    return out


@torch.no_grad()
def dense_greedy(target, prompt: list[int], n: int) -> list[int]:
    """Every token from a full recompute over the whole prefix: nothing freed, no cache."""
    x = list(prompt)
    for _ in range(n):
        h = target(torch.tensor(x), torch.arange(len(x)), DenseCausal(1, len(x)))
        x.append(int(target.logits(h[-1:])[0].argmax()))
    return x[len(prompt):]


def test_greedy_plain_equals_transformers(models, plain):
    hf = models[0]
    for prompt, got in zip(prompts(8), plain, strict=True):
        assert got == hf_greedy(hf, prompt, MAX_TOKENS)


@pytest.mark.parametrize("k", [0, 3])
def test_window_blocks_stay_bounded_and_output_equals_no_freeing(models, k):
    _, target, draft, _ = models
    eng = engine(target, draft if k else None, k=max(k, 1), chain=False, chunk=CHUNK,
                 kv=BLOCKS, drafter_kv=BLOCKS, sampled_drafts=False)
    ps = prompts(8)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0),
                        StopConditions(max_tokens=MAX_TOKENS))
    bound = math.ceil((WINDOW + max(k, 1)) / BLOCKS.block_size) + 1
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    freed = 0
    while eng.has_work:
        for out in eng.step():
            tokens[out.request_id].extend(out.new_tokens)
        for req in eng.running:
            table = req.claims.windows[WINDOW]
            assert table.held <= bound, (req.request_id, table.blocks)
            freed = max(freed, len(table.blocks) - table.held)
    assert freed >= 3  # sequences grew past the window: blocks went back
    for i, p in enumerate(ps):
        assert tokens[f"r{i}"] == dense_greedy(target, p, MAX_TOKENS)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_speculative_with_the_mtp_drafter_equals_plain(models, plain, k, batch):
    _, target, draft, _ = models
    eng = engine(target, draft, k=k, chain=False, chunk=CHUNK, kv=BLOCKS, drafter_kv=BLOCKS,
                 sampled_drafts=False)
    got, drafted, accepted = [], 0, 0
    ps = prompts(8)
    for i in range(0, 8, batch):
        tokens, result = outputs(eng, ps[i:i + batch], max_tokens=MAX_TOKENS)
        got += tokens
        drafted += sum(c.stats.draft_tokens for c in result.completions)
        accepted += sum(c.stats.accepted_tokens for c in result.completions)
    assert got == plain
    assert drafted > 0 and accepted > 0  # the drafter ran and some drafts were kept


# --- the MTP equations, written from the checkpoint tensors -----------------------------

def rms(x, w, eps=1e-5):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, theta, dim):
    # x [T, heads, D]; transformers' partial RoPE: frequencies over `dim` channels, pairs
    # (j, j + half) of the first 2 * half turn by position * f_j
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    half = len(freqs)
    rot = 2 * half
    angle = torch.arange(x.shape[0]).float()[:, None, None] * freqs  # [T, 1, half]
    a, b, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin(),
                      rest], -1)


def sliding_sink_attention(q, k, v, sinks, window):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    t = torch.arange(q.shape[0])
    s = s.masked_fill((t[None] > t[:, None]) | (t[None] <= t[:, None] - window), -torch.inf)
    s = torch.cat([s, sinks[:, None, None].expand(-1, len(t), 1)], -1)
    return torch.einsum("hts,shd->thd", s.softmax(-1)[..., :-1], v)


def reference_step(w, cfg, i, x_k, h):
    """MTP layer i over rows with token x[p+k] and the target's pre-norm h[p]."""
    p, lin = f"model.mtp.layers.{i}.", lambda name, z: z @ w[name].T
    emb = w["model.embed_tokens.weight"][x_k]
    u = torch.cat([rms(emb, w[p + "enorm.weight"]), rms(h, w[p + "hnorm.weight"])], -1)
    z = lin(p + "eh_proj.weight", u)
    n = rms(z, w[p + "input_layernorm.weight"])
    d, dv = cfg.head_dim, cfg.v_head_dim
    q, k, v = (lin(p + f"self_attn.{m}_proj.weight", n).view(len(z), -1, dim)
               for m, dim in (("q", d), ("k", d), ("v", dv)))
    theta = cfg.rope_parameters["sliding_attention"]["rope_theta"]
    rot = int(d * 0.334)  # partial_rotary_factor's default
    q, k = rope(q, theta, rot), rope(k, theta, rot)
    a = sliding_sink_attention(q, k, v, w[p + "self_attn.attention_sink_bias"], WINDOW)
    z = z + lin(p + "self_attn.o_proj.weight", a.reshape(len(z), -1))
    n = rms(z, w[p + "pre_mlp_layernorm.weight"])
    z = z + lin(p + "mlp.down_proj.weight",
                F.silu(lin(p + "mlp.gate_proj.weight", n)) * lin(p + "mlp.up_proj.weight", n))
    return z, rms(z, w[p + "final_layernorm.weight"]) @ w["lm_head.weight"].T


@torch.no_grad()
def test_drafter_matches_the_reference_equations(models):
    hf, target, draft, path = models
    w = {**load_file(str(path / "model.safetensors")),
         **load_file(str(path / "mtp.safetensors"))}
    x = torch.tensor(prompts(8)[6] + prompts(8)[2][:8])  # 29 tokens, past the window
    n = len(x) - 5
    h = target(x[:n], torch.arange(n), DenseCausal(1, n))  # the exported h: before the norm
    normed = hf.model(input_ids=x[None, :n]).last_hidden_state[0]  # after the final norm
    torch.testing.assert_close(rms(h, w["model.norm.weight"]), normed, atol=1e-5, rtol=1e-5)
    assert (h - normed).abs().max() > 0.1  # h itself is the un-normed one
    for k in range(1, NUM_MTP + 2):  # step 4 reuses layer 0
        g = draft.step(k, x[k:k + n], h, torch.arange(n), DenseCausal(1, n))  # non-chain
        g_ref, logits_ref = reference_step(w, hf.config, (k - 1) % NUM_MTP, x[k:k + n], h)
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4, msg=f"g at step {k}")
        torch.testing.assert_close(draft.logits(k, g), logits_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("drop", "reshape"), [
    ("model.mtp.layers.2.self_attn.attention_sink_bias", None),
    (None, "model.mtp.layers.1.pre_mlp_layernorm.weight")])
def test_a_missing_or_misshaped_mtp_tensor_is_named_in_one_line(tmp_path, drop, reshape):
    hf = write_target(tmp_path, seed=2)
    write_mtp(tmp_path, hf.config, drop=drop, reshape=reshape)
    with pytest.raises(CheckpointError) as e:
        load_draft_model(tmp_path)
    assert (drop or reshape) in str(e.value) and "\n" not in str(e.value)

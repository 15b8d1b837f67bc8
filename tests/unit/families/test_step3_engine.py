"""Step-3.5-Flash through the verifier engine (prefill chunks of 5, blocks of 4, window 8):
greedy plain decoding equals transformers' own cached greedy decoding on prompts and
outputs that run past the window; the three chained MTP layers (hub layout
`model.layers.{N+i}.*`, each its own head, h before the final norm) load strictly, equal a
from-scratch reference of their equations (and not the non-chain or post-norm readings),
and speculative output equals plain at K = 1..4, batch 1/3/8."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DynamicCache

from chainspec.engine.kv_budget import KVBudget
from chainspec.models.attention import DenseCausal
from chainspec.models.errors import CheckpointError
from chainspec.models.loader import load_draft_model, load_target
from chainspec.training.mtp_export import check_target, write_folder
from chainspec.training.mtp_model import TargetWithMTP
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families.step3_checkpoint import (
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
N = 4  # target layers: the MTP layers are model.layers.4..6


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
    path = tmp_path_factory.mktemp("step3_engine")
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
    logits = hf(torch.tensor([prompt]), cache=cache, use_cache=True)[0]
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = hf(torch.tensor([out[-1:]]), cache=cache, use_cache=True)[0]
    return out


def test_greedy_plain_equals_transformers(models, plain):
    hf = models[0]
    for prompt, got in zip(prompts(8), plain, strict=True):
        assert got == hf_greedy(hf, prompt, MAX_TOKENS)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_speculative_with_the_chained_mtp_drafter_equals_plain(models, plain, k, batch):
    _, target, draft, _ = models
    assert draft.glue.chains and draft.num_modules == NUM_MTP
    eng = engine(target, draft, k=k, chain=True, chunk=CHUNK, kv=BLOCKS, drafter_kv=BLOCKS,
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

def zc_norm(x, w, eps=1e-5):
    """Zero-centred RMSNorm: rmsnorm(x) * (1 + w)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + w)


def rope(x, theta):
    # x [T, heads, D], full rotary (the MTP layers' sliding kind): pairs (j, j + D/2)
    d = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angle = torch.arange(x.shape[0]).float()[:, None, None] * freqs  # [T, 1, D/2]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], -1)


def sliding_attention(q, k, v, window, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    t = torch.arange(q.shape[0])
    s = s.masked_fill((t[None] > t[:, None]) | (t[None] <= t[:, None] - window), -torch.inf)
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def reference_step(w, cfg, i, x_k, prev):
    """MTP layer i over rows with token x[p+k] and the hidden it reads at p."""
    p, lin = f"model.layers.{N + i}.", lambda name, z: z @ w[name].T
    emb = w["model.embed_tokens.weight"][x_k]
    u = torch.cat([zc_norm(emb, w[p + "enorm.weight"]), zc_norm(prev, w[p + "hnorm.weight"])],
                  -1)
    z = lin(p + "eh_proj.weight", u)
    n = zc_norm(z, w[p + "input_layernorm.weight"])
    d = cfg.head_dim
    q, k, v = (lin(p + f"self_attn.{m}_proj.weight", n).view(len(z), -1, d) for m in "qkv")
    q = zc_norm(q, w[p + "self_attn.q_norm.weight"])
    k = zc_norm(k, w[p + "self_attn.k_norm.weight"])
    theta = cfg.rope_parameters["sliding_attention"]["rope_theta"]
    a = sliding_attention(rope(q, theta), rope(k, theta), v, WINDOW,
                          cfg.query_pre_attn_scalar ** -0.5)
    a = a * torch.sigmoid(lin(p + "self_attn.g_proj.weight", n))[..., None]
    z = z + lin(p + "self_attn.o_proj.weight", a.reshape(len(z), -1))
    n = zc_norm(z, w[p + "post_attention_layernorm.weight"])
    z = z + lin(p + "mlp.down_proj.weight",
                F.silu(lin(p + "mlp.gate_proj.weight", n)) * lin(p + "mlp.up_proj.weight", n))
    logits = zc_norm(z, w[p + "shared_head.norm.weight"]) @ w[p + "shared_head.output.weight"].T
    return z, logits


@torch.no_grad()
def test_drafter_matches_the_reference_equations(models):
    hf, target, draft, path = models
    w = {**load_file(str(path / "model.safetensors")),
         **load_file(str(path / "mtp.safetensors"))}
    x = torch.tensor(prompts(8)[6] + prompts(8)[2][:8])  # 29 tokens, past the window
    n = len(x) - 5
    h = target(x[:n], torch.arange(n), DenseCausal(1, n))  # the exported h: before the norm
    normed = hf.model(input_ids=x[None, :n]).last_hidden_state[0]  # after the final norm
    torch.testing.assert_close(zc_norm(h, w["model.norm.weight"]), normed, atol=1e-5,
                               rtol=1e-5)
    assert (h - normed).abs().max() > 0.1  # h itself is the un-normed one
    g, g_ref = h, h
    for k in range(1, NUM_MTP + 2):  # step 4 reuses layer 0
        g = draft.step(k, x[k:k + n], g, torch.arange(n), DenseCausal(1, n))  # chained
        g_ref, logits_ref = reference_step(w, hf.config, (k - 1) % NUM_MTP, x[k:k + n], g_ref)
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4, msg=f"g at step {k}")
        torch.testing.assert_close(draft.logits(k, g), logits_ref, atol=2e-5, rtol=1e-4)
    # the readings other engines took give other drafts: the reference tells them apart
    g1 = reference_step(w, hf.config, 0, x[1:1 + n], h)[0]
    chained = reference_step(w, hf.config, 1, x[2:2 + n], g1)[1]
    for wrong in (h, zc_norm(g1, w[f"model.layers.{N}.shared_head.norm.weight"])):
        assert (reference_step(w, hf.config, 1, x[2:2 + n], wrong)[1] - chained).abs().max() > 0.1
    shared_head = zc_norm(g1, w[f"model.layers.{N}.shared_head.norm.weight"]) @ w[
        "lm_head.weight"].T
    assert (draft.logits(1, g1) - shared_head).abs().max() > 0.1  # its own head, not lm_head


@torch.no_grad()
def test_train_mtp_modules_load_back_in_the_family_layout(tmp_path):
    """`train-mtp` for a release that dropped its MTP layers (the config declares three,
    no tensors): two modules written at model.layers.{N+i}.*, each head starting as the
    target's, loaded by `load_draft_model` into the drafter that was trained."""
    target_dir, out = tmp_path / "target", tmp_path / "out"
    write_target(target_dir, seed=4)
    check_target(target_dir, out)
    trained = TargetWithMTP(load_target(target_dir), 2)
    trained.init_mtp(seed=3, std=0.3)
    assert torch.equal(trained.draft.mtp[1].head.weight, trained.target.lm_head.weight)
    write_folder(trained, target_dir, out, copy=False)
    draft = load_draft_model(out)
    assert draft.num_modules == 2 and draft.mtp[0].block.self_attn.shape.window == WINDOW
    gen = torch.Generator().manual_seed(0)
    x, h = torch.randint(0, 256, (14,), generator=gen), torch.randn(11, 32, generator=gen)
    ours, theirs = h, h
    for k in (1, 2, 3):
        ours = draft.step(k, x[k:k + 11], ours, torch.arange(11), DenseCausal(1, 11))
        theirs = trained.draft.step(k, x[k:k + 11], theirs, torch.arange(11),
                                    DenseCausal(1, 11))
        torch.testing.assert_close(draft.logits(k, ours), trained.draft.logits(k, theirs))


@pytest.mark.parametrize(("drop", "reshape"), [
    ("model.layers.6.shared_head.output.weight", None),
    ("model.layers.4.self_attn.k_norm.weight", None),
    (None, "model.layers.5.self_attn.g_proj.weight")])
def test_a_missing_or_misshaped_mtp_tensor_is_named_in_one_line(tmp_path, drop, reshape):
    hf = write_target(tmp_path, seed=2)
    write_mtp(tmp_path, hf.config, drop=drop, reshape=reshape)
    with pytest.raises(CheckpointError) as e:
        load_draft_model(tmp_path)
    assert (drop or reshape) in str(e.value) and "\n" not in str(e.value)

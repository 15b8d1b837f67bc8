"""DeepSeek-V3 with dense layers (MLA + SwiGLU), against transformers and the MTP equations.

- Target logits equal `DeepseekV3ForCausalLM`'s at every position (fp32), through the
  engine's latent paged cache (packed prefill chunks, decode rows, verify-sized windows)
  and through DenseCausal: low-rank q or q_proj, interleaved RoPE or not, yarn with
  DeepSeek's mscale in the softmax scale.
- Greedy plain decoding in the engine equals transformers' `generate` token for token on
  prompts that cross prefill-chunk and block boundaries.
- The MTP layer (`model.layers.{N}`, native layout, random weights) loads through
  `load_draft_model` with its MLA block, and matches a plainly written reference of the
  family's equations; greedy speculative output equals plain at K = 1..4, batch 1/3/8;
  modules that `train-mtp` writes for a DeepSeek target load back in that layout.
- DESIGN 3.5: per-position acceptance in the engine (packed and static verify buffers)
  equals the offline simulation within 0.02, and a non-chained mutant fails the check.
- A missing or mis-shaped MTP tensor fails with one line naming it (MoE layers:
  test_deepseek_v3_moe.py).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.runner import merged_stats
from chainspec.engine.verify_graphs import VerifyGraphs
from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.errors import CheckpointError
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.mla import LatentAttention
from chainspec.training.evaluate import simulate_rounds
from chainspec.training.mtp_export import write_folder
from chainspec.training.mtp_model import TargetWithMTP
from tests.acceptance_audit import (
    TOLERANCE,
    assert_acceptance_matches,
    engine_acceptance,
    rate_gaps,
)
from tests.unit.engine_fixtures import engine, outputs, prompts
from tests.unit.families.deepseek_v3_checkpoint import (
    YARN,
    mtp_prefix,
    write_target,
    write_with_mtp,
)

VOCAB = 256
BLOCK = 4
CASES = {"q_lora": {}, "q_proj": {"q_lora_rank": None}, "yarn_mscale": {"rope_parameters": YARN},
         "no_interleave": {"rope_interleave": False}}
LENGTHS = {"a": 9, "b": 11, "c": 5}
TABLES = {"a": [5, 0, 7], "b": [1, 8, 3], "c": [6, 2]}  # out of order: mix-ups show
SCHEDULE = [
    {"a": (0, 7), "b": (0, 4), "c": (0, 1)},  # a prefill, b first chunk, c one row
    {"a": (7, 8), "b": (4, 11), "c": (1, 3)},  # a decode, b last chunk, c 2-row chunk
    {"a": (8, 9), "c": (3, 5)},  # a decode, c verify-sized window
]


def random_ids() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {s: torch.randint(0, VOCAB, (n,), generator=gen) for s, n in LENGTHS.items()}


@torch.no_grad()
def packed_logits(model, ids):
    cache = ModelKVCache(model.cache_specs(), {None: 9}, BLOCK)
    rows = {s: [] for s in ids}
    for step in SCHEDULE:
        batch = AttnBatch.build([SeqRows(TABLES[s], lo, hi - lo)
                                 for s, (lo, hi) in step.items()], BLOCK)
        tokens = torch.cat([ids[s][lo:hi] for s, (lo, hi) in step.items()])
        logits = model.logits(model(tokens, batch.positions, PagedAttention(cache, batch)))
        for s, part in zip(step, logits.split([hi - lo for lo, hi in step.values()]),
                           strict=True):
            rows[s].append(part)
    return {s: torch.cat(parts) for s, parts in rows.items()}


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_logits_match_transformers(tmp_path, case):
    hf, _ = write_with_mtp(tmp_path, **CASES[case])
    model = load_target(tmp_path)  # strict; model.layers.2.* are MTP, not leftovers
    ids = random_ids()
    want = {s: hf(input_ids=t[None]).logits[0] for s, t in ids.items()}
    paged = packed_logits(model, ids)
    for s, t in ids.items():
        dense = model.logits(model(t, torch.arange(len(t)), DenseCausal(1, len(t))))
        assert want[s].abs().max() > 1.0  # large enough that a mismatch shows
        torch.testing.assert_close(paged[s], want[s], atol=1e-4, rtol=1e-5, msg=f"paged {s}")
        torch.testing.assert_close(dense, want[s], atol=1e-4, rtol=1e-5, msg=f"dense {s}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    hf, tensors = write_with_mtp(path)
    return path, hf, tensors


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """A quiet target and an MTP layer that guesses it often: drafts at stake."""
    path = tmp_path_factory.mktemp("deepseek_v3_agreeing")
    write_with_mtp(path, agreeing=True)
    return path


def verifier(path, draft=None, k: int = 1, chain: bool = True):
    kv = KVBudget(block_size=BLOCK)
    return engine(load_target(path), draft, k=k, chain=chain, chunk=5, kv=kv, drafter_kv=kv)


def test_greedy_generation_equals_transformers(checkpoint):
    path, hf, _ = checkpoint
    batch = prompts(3, VOCAB, seed=3)  # lengths 2..24 over chunks of 5, blocks of 4
    got, _ = outputs(verifier(path), batch, max_tokens=12)
    for prompt, tokens in zip(batch, got, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               min_new_tokens=12)[0, len(prompt):].tolist()
        assert tokens == want


@pytest.fixture(scope="module")
def plain(agreeing):
    return outputs(verifier(agreeing), prompts(8, VOCAB, seed=5), max_tokens=16)[0]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_speculative_equals_plain(agreeing, plain, k, batch):
    draft = load_draft_model(agreeing)
    assert isinstance(draft.mtp[0].block.self_attn, LatentAttention)
    eng, every = verifier(agreeing, draft, k), prompts(8, VOCAB, seed=5)
    tokens, completions = [], []
    for i in range(0, len(every), batch):
        got, result = outputs(eng, every[i:i + batch], max_tokens=16)
        tokens += got
        completions += result.completions
    assert tokens == plain
    stats = merged_stats(completions, k)  # drafts were at stake, at every depth
    assert stats.accepted_tokens > 0.15 * stats.draft_tokens
    assert stats.accepted_per_pos[k - 1] > 0


@pytest.mark.parametrize("mode", ["packed", "static"])
def test_acceptance_equals_the_offline_simulation(agreeing, mode):
    """DESIGN 3.5: per-position acceptance in the engine (the verifier's packed path with
    the drafter's static buffers; or the verifier's static verify buffers with the
    drafter's packed path) equals `simulate_rounds` of the same modules within 0.02."""
    k, every = 3, prompts(8, VOCAB, seed=7)
    draft = load_draft_model(agreeing)
    eng = verifier(agreeing, draft, k)
    if mode == "static":
        eng.graphs = VerifyGraphs(eng.model, eng.cache, eng.config.max_seqs, k,
                                  eng.config.max_len, use_graphs=False, static_on_cpu=True)
        eng.drafter.engine.runner.fits = lambda windows: False
    want = simulate_rounds(eng.model, draft, every, k, 16)
    got = engine_acceptance(eng, every, 16)
    assert min(want.rates) > 0.05  # drafts at stake at every position
    assert_acceptance_matches(got, want)


def test_acceptance_check_fails_when_steps_read_the_target_hidden_state(agreeing):
    """The mutant: steps 2..K fed h instead of g[k-1] (a drafter in non-chain mode)
    against the chained simulation: the check must see it."""
    k, every = 3, prompts(8, VOCAB, seed=7)
    draft = load_draft_model(agreeing)
    eng = verifier(agreeing, draft, k, chain=False)
    want = simulate_rounds(eng.model, draft, every, k, 16)
    assert max(rate_gaps(engine_acceptance(eng, every, 16), want)) > TOLERANCE


# --- the MTP equations, written plainly from the checkpoint tensors ------------------------

def rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def linear(t, name, x):
    return x @ t[name + ".weight"].T


def rope_pairs(x, positions, dim, theta=10000.0):
    """DeepSeek's interleaved RoPE: pair (2i, 2i+1) turns by pos * theta^(-2i/dim)."""
    freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = (positions[:, None].double() * freqs).float()[:, None, :]  # [T, 1, dim/2]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * angle.cos() - b * angle.sin()
    out[..., 1::2] = b * angle.cos() + a * angle.sin()
    return out


def mla(t, p, cfg, x, positions):
    heads, nope, rd, vd, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                              cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
    a = p + "self_attn."
    q = linear(t, a + "q_b_proj", rms(linear(t, a + "q_a_proj", x), t[a + "q_a_layernorm.weight"]))
    q_nope, q_pe = q.view(len(x), heads, -1).split([nope, rd], -1)
    c, k_pe = linear(t, a + "kv_a_proj_with_mqa", x).split([r, rd], -1)
    k_nope, v = linear(t, a + "kv_b_proj", rms(c, t[a + "kv_a_layernorm.weight"])).view(
        len(x), heads, -1).split([nope, vd], -1)
    q = torch.cat([q_nope, rope_pairs(q_pe, positions, rd)], -1)
    k = torch.cat([k_nope, rope_pairs(k_pe[:, None], positions, rd).expand(-1, heads, -1)], -1)
    scores = torch.einsum("thd,shd->hts", q, k) / (nope + rd) ** 0.5
    future = torch.ones(len(x), len(x), dtype=torch.bool).triu(1)
    o = torch.einsum("hts,shd->thd", scores.masked_fill(future, float("-inf")).softmax(-1), v)
    return linear(t, a + "o_proj", o.reshape(len(x), -1))


def block(t, p, cfg, x, positions):
    eps = cfg.rms_norm_eps
    x = x + mla(t, p, cfg, rms(x, t[p + "input_layernorm.weight"], eps), positions)
    n = rms(x, t[p + "post_attention_layernorm.weight"], eps)
    gate, up = linear(t, p + "mlp.gate_proj", n), linear(t, p + "mlp.up_proj", n)
    return x + linear(t, p + "mlp.down_proj", gate * torch.sigmoid(gate) * up)


def reference_steps(t, cfg, x, h, num_modules, num_steps):
    """Chain mode: u = [enorm(E x[p+k]), hnorm(g[k-1])], g[k] = Block(eh_proj u),
    logits = head(shared_head.norm(g[k])), g[0] = h."""
    eps, positions, prev, out = cfg.rms_norm_eps, torch.arange(len(h)), h, []
    for k in range(1, num_steps + 1):
        p = mtp_prefix(cfg, (k - 1) % num_modules)
        e = rms(t[p + "embed_tokens.weight"][x[k: k + len(h)]], t[p + "enorm.weight"], eps)
        u = torch.cat([e, rms(prev, t[p + "hnorm.weight"], eps)], -1)
        g = block(t, p, cfg, u @ t[p + "eh_proj.weight"].T, positions)
        out.append((g, rms(g, t[p + "shared_head.norm.weight"], eps)
                    @ t[p + "shared_head.head.weight"].T))
        prev = g
    return out


def assert_steps_equal(ours, ref):
    for k, ((g, logits), (g_ref, logits_ref)) in enumerate(zip(ours, ref, strict=True), 1):
        torch.testing.assert_close(g, g_ref, atol=3e-5, rtol=1e-4, msg=f"g at step {k}")
        torch.testing.assert_close(logits, logits_ref, atol=3e-5, rtol=1e-4,
                                   msg=f"logits at step {k}")


SEQ = 10


def inputs(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (SEQ + 4,), generator=gen)
    return x, torch.randn(SEQ, cfg.hidden_size, generator=gen)


@pytest.mark.parametrize("modules", [1, 2])
@torch.no_grad()
def test_drafter_matches_reference(tmp_path, modules):
    """Dense, then two sequences packed in two chunks each through the paged MTP cache."""
    hf, t = write_with_mtp(tmp_path, num_layers=modules)
    cfg, steps = hf.config, 3
    model = load_draft_model(tmp_path)
    assert model.num_modules == modules
    x, h = inputs(cfg, 0)
    prev, dense = h, []
    for k in range(1, steps + 1):
        prev = model.step(k, x[k: k + SEQ], prev, torch.arange(SEQ), DenseCausal(1, SEQ))
        dense.append((prev, model.logits(k, prev)))
    assert_steps_equal(dense, reference_steps(t, cfg, x, h, modules, steps))

    seqs, tables = {0: inputs(cfg, 1), 1: inputs(cfg, 2)}, {0: [4, 1, 3], 1: [0, 5, 2]}
    cache = ModelKVCache(model.cache_specs(steps), {None: 6}, BLOCK)
    got = {s: [[] for _ in range(steps)] for s in seqs}
    for chunk in ({0: (0, 4), 1: (0, 7)}, {0: (4, SEQ), 1: (7, SEQ)}):
        batch = AttnBatch.build([SeqRows(tables[s], lo, hi - lo) for s, (lo, hi) in
                                 chunk.items()], BLOCK)
        backend = PagedAttention(cache, batch)
        prev = torch.cat([seqs[s][1][lo:hi] for s, (lo, hi) in chunk.items()])
        for k in range(1, steps + 1):
            tokens = torch.cat([seqs[s][0][lo + k: hi + k] for s, (lo, hi) in chunk.items()])
            prev = model.step(k, tokens, prev, batch.positions, backend)
            for s, part in zip(chunk, prev.split([hi - lo for lo, hi in chunk.values()]),
                               strict=True):
                got[s][k - 1].append(part)
    for s, (x, h) in seqs.items():
        ours = [(torch.cat(g), model.logits(k, torch.cat(g))) for k, g in enumerate(got[s], 1)]
        assert_steps_equal(ours, reference_steps(t, cfg, x, h, modules, steps))


@torch.no_grad()
def test_train_mtp_modules_load_back_in_the_family_layout(tmp_path):
    """`train-mtp`'s output for a DeepSeek target: MLA blocks at model.layers.{N+i},
    loaded by `load_draft_model` into the same drafter that was trained."""
    target_dir, out = tmp_path / "target", tmp_path / "out"
    write_target(target_dir, num_nextn_predict_layers=0)
    trained = TargetWithMTP(load_target(target_dir), 2)
    trained.init_mtp(seed=3, std=0.3)
    write_folder(trained, target_dir, out, copy=False)
    draft = load_draft_model(out)
    assert draft.num_modules == 2 and isinstance(draft.mtp[1].block.self_attn, LatentAttention)
    x, h = inputs(trained.config, 0)
    ours, theirs = h, h
    for k in (1, 2):
        ours = draft.step(k, x[k: k + SEQ], ours, torch.arange(SEQ), DenseCausal(1, SEQ))
        theirs = trained.draft.step(k, x[k: k + SEQ], theirs, torch.arange(SEQ),
                                    DenseCausal(1, SEQ))
        torch.testing.assert_close(draft.logits(k, ours), trained.draft.logits(k, theirs))


# --- errors -------------------------------------------------------------------------------

def rewrite_mtp(path, change):
    tensors = load_file(str(path / "mtp.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "mtp.safetensors"))


def one_line_error(call) -> str:
    with pytest.raises(CheckpointError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_mtp_tensor_is_named(tmp_path):
    write_with_mtp(tmp_path)
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    rewrite_mtp(tmp_path, lambda t: t.pop(name))
    assert name in one_line_error(lambda: load_draft_model(tmp_path))


def test_misshaped_mtp_tensor_is_named(tmp_path):
    write_with_mtp(tmp_path)
    name = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    rewrite_mtp(tmp_path, lambda t: t.update({name: t[name][:-1].clone()}))
    msg = one_line_error(lambda: load_draft_model(tmp_path))
    assert name in msg and "shape" in msg


def test_moe_mtp_block_tensors_are_named(tmp_path):
    """An all-dense target's MTP layer is dense: expert tensors there are refused
    (MoE targets: test_deepseek_v3_moe.py)."""
    write_with_mtp(tmp_path)
    name = "model.layers.2.mlp.experts.gate_up_proj"
    rewrite_mtp(tmp_path, lambda t: t.update({name: torch.zeros(4, 8, 32)}))
    assert name in one_line_error(lambda: load_draft_model(tmp_path))

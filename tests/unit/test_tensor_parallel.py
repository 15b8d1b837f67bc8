"""Tensor parallel = TP=1 (DESIGN 4.10, issue 22): a TP=2 group on CPU (gloo), rank 0 in
this process owning the VerifierEngine, rank 1 a spawned process following it in
lockstep. For the demo model (4 heads over 2 KV heads, tied embeddings), a tiny Llama
(1 KV head: replicated; untied, odd vocab: an uneven vocab split, q/k/v biases) and a
tiny DeepSeek-V3 with dense layers (MLA by heads, the latent cache replicated) and one
with MoE layers (experts split across the ranks, per-expert tensors read per rank),
Qwen3.5 (GDN by key heads + gated attention), Qwen3-Next (fused GDN projections, MoE with
a gated shared expert) and MiMo-V2-Flash (sliding window with sinks):
logits match TP=1 within fp32 tolerance, greedy output is identical token for token,
speculative output (in-process drafter on rank 0) equals plain, the KV cache holds the
local heads, and each rank holds 1/N of the sharded parameters and reads no more."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from chainspec.engine.factory import LoadedModels, build_verifier_engine, load_models
from chainspec.engine.fingerprint import model_fingerprint
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.tp_launch import start_local_group
from chainspec.models.attention import DenseCausal
from chainspec.models.cache_spec import PagedSpec, StateSpec
from chainspec.models.config import ModelConfig
from chainspec.models.tensor_parallel import (
    LocalExperts,
    TPError,
    TPGroup,
    check_divides,
    sharded_numel,
)
from tests.unit.checkpoints import demo_checkpoint
from tests.unit.families.deepseek_v3_checkpoint import MOE, write_with_mtp
from tests.unit.families.mimo_v2_flash_checkpoint import write_checkpoint as write_mimo_v2
from tests.unit.families.qwen3_5_checkpoint import write_checkpoint as write_qwen3_5
from tests.unit.families.qwen3_next_checkpoint import write_checkpoint as write_qwen3_next

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 9, 13, 2, 7, 30, 11], [3] * 21, [17, 4, 60, 8, 1, 12, 6, 45, 33, 2, 9]]


def _tiny(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tp_llama")
    demo_checkpoint(model_dir, mtp=2)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # 1 KV head (replicated over 2 ranks), vocab 63 (uneven split), Qwen2 biases
    cfg.update(num_key_value_heads=1, vocab_size=63, architectures=["Qwen2ForCausalLM"])
    cfg_path.write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(3)
    for name in ("model.safetensors", "mtp.safetensors"):
        tensors = load_file(str(model_dir / name))
        out = {}
        for key, t in tensors.items():
            if key.endswith(("k_proj.weight", "v_proj.weight")):
                t = t[:8].contiguous()
            if key.endswith(("embed_tokens.weight", "lm_head.weight")):
                t = t[:63].contiguous()
            out[key] = t
            if key.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                bias = key[:-len("weight")] + "bias"
                out[bias] = torch.randn(out[key].shape[0], generator=gen) * 0.1
        save_file(out, str(model_dir / name))
    return model_dir


def _deepseek_mla(tmp_path_factory):
    """DeepSeek-V3 with dense layers: MLA (low-rank q, latent cache) + SwiGLU."""
    model_dir = tmp_path_factory.mktemp("tp_mla")
    write_with_mtp(model_dir, agreeing=True)
    return model_dir


def _deepseek_moe(tmp_path_factory):
    """DeepSeek-V3 with MoE from layer 1 (8 experts stored per expert, grouped sigmoid
    router, one shared expert): experts split 4 + 4 (expert parallel)."""
    model_dir = tmp_path_factory.mktemp("tp_moe")
    write_with_mtp(model_dir, agreeing=True, **MOE)
    return model_dir


def _qwen3_5_gdn(tmp_path_factory):
    """Qwen3.5: three Gated DeltaNet layers (2 key heads, 4 value heads) and one gated
    full-attention layer (4 heads over 2 KV heads)."""
    model_dir = tmp_path_factory.mktemp("tp_gdn")
    write_qwen3_5(model_dir)
    return model_dir


def _mimo_sliding(tmp_path_factory):
    """MiMo-V2-Flash: full layers (1 KV head: replicated) and sliding-window layers
    (window 8, 2 KV heads, attention sinks; values of their own width)."""
    model_dir = tmp_path_factory.mktemp("tp_sliding")
    write_mimo_v2(model_dir)
    return model_dir


def _qwen3_next(tmp_path_factory):
    """Qwen3-Next: GDN with fused per-key-head projections, gated full attention, MoE
    (4 experts, a gated shared expert) and one dense layer."""
    model_dir = tmp_path_factory.mktemp("tp_next")
    write_qwen3_next("qwen3_next", model_dir)
    return model_dir


CHECKPOINTS = {"demo": lambda _: DEMO_MODEL, "tiny_llama": _tiny, "deepseek_mla": _deepseek_mla,
               "deepseek_moe": _deepseek_moe, "qwen3_5_gdn": _qwen3_5_gdn,
               "mimo_v2_sliding": _mimo_sliding, "qwen3_next": _qwen3_next}


def _first_paged(specs) -> PagedSpec:
    return next(s for s in specs if isinstance(s, PagedSpec))


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def group(request, tmp_path_factory):
    model_dir = CHECKPOINTS[request.param](tmp_path_factory)
    opts = LocalOptions(model_dir=model_dir, num_steps=3, max_seqs=4, max_len=128,
                        kv_block_size=4)
    reference = load_models(opts, speculative=True)
    tp = start_local_group(model_dir, 2, cache_len=opts.max_len)
    try:
        yield opts, reference, tp.leader
    finally:
        tp.close()


def _generate(engine, prompts):
    stop = StopConditions(max_tokens=20, ignore_eos=True)
    completions = run_to_completion(engine, prompts, GREEDY, stop).completions
    _generate.accepted = merged_stats(completions, engine.config.num_steps).accepted_tokens
    return [c.tokens for c in completions]


def test_logits_match_tp1(group):
    opts, reference, leader = group
    ids = torch.tensor(PROMPTS[2] * 3)
    n = ids.shape[0]
    with torch.inference_mode():
        want = reference.target.logits(reference.target(
            ids, torch.arange(n), DenseCausal(1, n, reference.target.attention_scale)))
        got = leader.logits(leader(ids, torch.arange(n), DenseCausal(1, n,
                                                                     leader.attention_scale)))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_and_speculative_equal_tp1(group):
    """Prompts cross prefill chunks (chunk 8) and blocks (4 positions); batch 3."""
    opts, reference, leader = group
    opts1 = dataclasses.replace(opts, use_graphs=False)
    plain = _generate(build_verifier(reference, opts1, speculative=False), PROMPTS)
    tp_models = LoadedModels(leader, reference.draft)
    engine = build_verifier_engine(leader, opts1, None)
    engine.config = dataclasses.replace(engine.config, prefill_chunk=8)
    assert _generate(engine, PROMPTS) == plain
    spec = _first_paged(reference.target.cache_specs())  # TP=1's
    local = 1 if spec.latent or spec.num_kv_heads < 2 else spec.num_kv_heads // 2
    assert engine.cache.keys[0].shape[2] == local  # the cache holds this rank's heads
    for full, mine in zip(reference.target.cache_specs(), leader.cache_specs(), strict=True):
        if isinstance(full, StateSpec):  # GDN: conv channels and value heads halved
            assert [s[0] * 2 for s in mine.shapes] == [s[0] for s in full.shapes]
    for k in (1, 3):
        spec_opts = dataclasses.replace(opts1, num_steps=k)
        spec = build_verifier(tp_models, spec_opts, speculative=True)
        assert _generate(spec, PROMPTS) == plain
        accepted = _generate.accepted
        _generate(build_verifier(reference, spec_opts, speculative=True), PROMPTS)
        assert accepted == _generate.accepted  # TP=1's verdicts, draft for draft


def test_prefix_cache_hits_on_a_group_equal_tp1_without_caching(group):
    """Requests one after another sharing a prefix (prefix caching on, the default):
    rank 0 hands out shared blocks, every rank reads them, output is TP=1's uncached."""
    opts, reference, leader = group
    off = dataclasses.replace(opts, use_graphs=False, enable_prefix_caching=False)
    shared = [(3 * i) % 50 + 1 for i in range(13)]
    prompts = [shared + p for p in PROMPTS]
    plain = [_generate(build_verifier(reference, off, speculative=False), [p])[0]
             for p in prompts]
    on = dataclasses.replace(off, enable_prefix_caching=True)
    engine = build_verifier(LoadedModels(leader, reference.draft), on, speculative=True)
    assert [_generate(engine, [p])[0] for p in prompts] == plain
    cache = engine.allocator.cache
    assert cache is None or cache.hits > 0  # None: a model with states or windows


def test_each_rank_holds_half_of_the_sharded_parameters(group):
    opts, reference, leader = group
    shard = leader.shard
    cfg = reference.target.config
    replicated_kv = _first_paged(reference.target.cache_specs()).num_kv_heads < 2
    split = {k: s for k, s in shard.tp_shards.items()
             if not (replicated_kv and k.endswith(("k_proj.weight", "k_proj.bias",
                                                    "v_proj.weight", "v_proj.bias")))}
    local, full = sharded_numel(shard, split)
    experts = [m for m in shard.modules() if isinstance(m, LocalExperts)]
    moe_layers = {"tp_moe": 1, "tp_next": 3}.get(opts.model_dir.name.rstrip("0123456789"), 0)
    assert len(experts) == moe_layers
    assert all(m.gate_up_proj.shape[0] == m.stop - m.start for m in experts)
    assert all(2 * (m.stop - m.start) == reference.target.config.moe.router.num_experts
               for m in experts)
    vocab_pad = cfg.vocab_size % 2 * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert 2 * local == full + vocab_pad  # rank 0 takes the larger vocab share
    target_bytes = sum(p.numel() for p in reference.target.parameters()) * 4
    stored = 2 if opts.model_dir == DEMO_MODEL else 4  # the demo is stored in bf16
    assert shard.tp_bytes_read * 4 / stored < 0.6 * target_bytes


def test_fingerprint_equals_tp1(group):
    """A TP=2 verifier pairs with the drafters of its checkpoint: the same fingerprint
    over the full embedding and head, streamed from both ranks."""
    _, reference, leader = group
    assert model_fingerprint(leader) == model_fingerprint(reference.target)
    assert model_fingerprint(leader) == model_fingerprint(reference.draft)


def test_a_size_that_does_not_divide_the_heads_is_refused():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=48,
                      intermediate_size=96, num_layers=1, num_heads=6, num_kv_heads=2,
                      head_dim=8, max_position=64)
    with pytest.raises(TPError, match="does not divide the 6 attention heads"):
        check_divides(cfg, 4)
    with pytest.raises(TPError, match="2 KV heads cannot be replicated over tensor-par"):
        check_divides(cfg, 3)
    check_divides(cfg, 2)
    assert TPGroup(0, 2).world == 2


def test_each_rank_computes_only_the_pairs_of_its_own_experts(monkeypatch):
    """Expert parallel: rank r's experts run exactly the (row, slot) pairs routed to them
    (counted at their gate/up projections; none passes through a local expert with
    weight 0), and the ranks' partial outputs sum to the full layer's."""
    import torch.nn.functional as F

    from chainspec.models.moe import Experts

    g = torch.Generator().manual_seed(7)
    full = Experts(8, 16, 8)
    with torch.no_grad():
        full.gate_up_proj.copy_(torch.randn(full.gate_up_proj.shape, generator=g) * 0.3)
        full.down_proj.copy_(torch.randn(full.down_proj.shape, generator=g) * 0.3)
    x = torch.randn(11, 16, generator=g)
    ids = torch.topk(torch.rand(11, 8, generator=g), 3, dim=-1).indices  # [T, k]
    ids[:4] = torch.tensor([0, 1, 2])  # rows routed to rank 0's experts only
    weights = torch.rand(11, 3, generator=g)
    counted: list[int] = []
    linear = F.linear

    def counting(inp, weight, bias=None):
        if weight.untyped_storage().data_ptr() == counting.storage:
            counted.append(inp.shape[0])
        return linear(inp, weight, bias)
    monkeypatch.setattr(F, "linear", counting)
    total = torch.zeros_like(x)
    with torch.no_grad():
        for rank, (start, stop) in enumerate(((0, 4), (4, 8))):
            mine = LocalExperts(start, stop, full)
            mine.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[start:stop].clone())
            mine.down_proj = torch.nn.Parameter(full.down_proj[start:stop].clone())
            counting.storage = mine.gate_up_proj.untyped_storage().data_ptr()
            counted.clear()
            total += mine(x, ids, weights)
            routed_here = int(((ids >= start) & (ids < stop)).sum())
            assert sum(counted) == routed_here < ids.numel(), (rank, counted)
        want = full(x, ids, weights)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)

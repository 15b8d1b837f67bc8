"""GLM-4.5 (`Glm4MoeForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`) against
transformers and the MTP equations (issue 21):

- target logits equal transformers' at every position (fp32), through the engine's paged
  cache (packed prefill chunks, decode rows, verify-sized windows) and DenseCausal: GLM
  with/without q/k norm and bias, group-limited or not; Qwen3-MoE with mlp_only_layers,
  decoder_sparse_step 2, with/without norm_topk_prob;
- routing decisions equal transformers' on the same hidden states, through each family's
  real layer, ties included;
- greedy plain decoding equals transformers' `generate` on prompts crossing prefill-chunk
  and block boundaries;
- the MTP layer in its layout (GLM's NextN layer at `model.layers.{N}`, MoE, experts per
  expert; Qwen3-MoE: the DeepSeek layout train-mtp writes) loads through
  `load_draft_model` with only the embedding, head and MTP layer resident, matches the
  plainly written equations (moe_stack_reference.py), and greedy speculative output
  equals plain at K = 1..4, batch 1/3/8; engine acceptance equals the offline
  simulation within 0.02; train-mtp's modules load back in the family layout;
- a missing or mis-shaped MTP tensor, an unsupported router or layer pattern, fails with
  one line naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from chainspec.cluster.plain_target import no_mtp_reason
from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.runner import merged_stats
from chainspec.engine.verify_graphs import VerifyGraphs
from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.config import ModelConfig
from chainspec.models.errors import CheckpointError
from chainspec.models.families import family_for
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.moe import SparseMoE
from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel
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
from tests.unit.families.moe_stack_checkpoint import (
    VOCAB,
    mtp_prefix,
    write_target,
    write_with_mtp,
)
from tests.unit.families.moe_stack_reference import reference_steps

FAMILIES = ("glm4_moe", "qwen3_moe")
BLOCK = 4
CASES = {
    "glm4_moe": {"default": {}, "plain_attention": {"use_qk_norm": False,
                                                    "attention_bias": False},
                 "one_group": {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}},
    "qwen3_moe": {"default": {}, "sparse_step_2": {"decoder_sparse_step": 2,
                                                   "mlp_only_layers": []},
                  "unnormalised": {"norm_topk_prob": False, "attention_bias": True}},
}
LENGTHS = {"a": 9, "b": 11, "c": 5}
TABLES = {"a": [5, 0, 7], "b": [1, 8, 3], "c": [6, 2]}  # out of order: mix-ups show
SCHEDULE = [
    {"a": (0, 7), "b": (0, 4), "c": (0, 1)},  # a prefill, b first chunk, c one row
    {"a": (7, 8), "b": (4, 11), "c": (1, 3)},  # a decode, b last chunk, c 2-row chunk
    {"a": (8, 9), "c": (3, 5)},  # a decode, c verify-sized window
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.mark.parametrize("family,case", [(f, c) for f in FAMILIES for c in CASES[f]])
@torch.no_grad()
def test_logits_match_transformers(tmp_path, family, case):
    hf, _ = write_with_mtp(tmp_path, family, **CASES[family][case])
    model = load_target(tmp_path)  # strict; model.layers.3.* are MTP, not leftovers
    want_sparse = [type(layer.mlp).__name__.endswith(("MoE", "MoeBlock"))
                   for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == want_sparse
    assert any(want_sparse) and not all(want_sparse)
    ids = random_ids()
    want = {s: hf(input_ids=t[None]).logits[0] for s, t in ids.items()}
    paged = packed_logits(model, ids)
    for s, t in ids.items():
        dense = model.logits(model(t, torch.arange(len(t)), DenseCausal(1, len(t))))
        assert want[s].abs().max() > 1.0  # large enough that a mismatch shows
        torch.testing.assert_close(paged[s], want[s], atol=1e-4, rtol=1e-5, msg=f"paged {s}")
        torch.testing.assert_close(dense, want[s], atol=1e-4, rtol=1e-5, msg=f"dense {s}")


def _router_calls(hf):
    """(input, (weights, ids)) of every router call of transformers' model, by layer."""
    calls = {}

    def record(i):
        def hook(module, args, out):
            calls[i] = (args[0].detach(), out)  # NOTE: returns None: output unchanged
        return hook

    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.register_forward_hook(record(i))
    return calls


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_routing_equals_transformers_with_ties(tmp_path, family):
    """Experts 2 and 5 of every router get identical scores (the same gate row and
    correction bias): the choice between them is a tie, broken as transformers does."""
    hf = write_target(tmp_path, family, seed=4)
    for layer in hf.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight[5] = gate.weight[2]
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias[5] = gate.e_score_correction_bias[2]
    hf.save_pretrained(tmp_path)
    model = load_target(tmp_path)
    calls = _router_calls(hf)
    hf(input_ids=random_ids()["b"][None])
    assert calls
    tied = 0
    for i, (x, out) in calls.items():
        want_w, want_ids = out[-2], out[-1]  # (logits, weights, ids) or (weights, ids)
        ids, weights = model.model.layers[i].mlp.gate(x.reshape(-1, x.shape[-1]))
        assert torch.equal(ids, want_ids), f"layer {i}"
        torch.testing.assert_close(weights, want_w.float(), atol=1e-6, rtol=1e-6)
        tied += int(((ids == 2) | (ids == 5)).any(-1).sum())
    assert tied > 0  # the tied experts were chosen somewhere


def verifier(path, draft=None, k: int = 1):
    kv = KVBudget(block_size=BLOCK)
    return engine(load_target(path), draft, k=k, chain=True, chunk=5, kv=kv, drafter_kv=kv)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers(tmp_path, family):
    hf, _ = write_with_mtp(tmp_path, family)
    batch = prompts(3, VOCAB, seed=3)  # lengths 2..24 over chunks of 5, blocks of 4
    got, _ = outputs(verifier(tmp_path), batch, max_tokens=12)
    for prompt, tokens in zip(batch, got, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               min_new_tokens=12)[0, len(prompt):].tolist()
        assert tokens == want


# --- the MTP layer ----------------------------------------------------------------------

SEQ = 10


def inputs(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (SEQ + 4,), generator=gen)
    return x, torch.randn(SEQ, cfg.hidden_size, generator=gen)


def assert_steps_equal(ours, ref):
    for k, ((g, logits), (g_ref, logits_ref)) in enumerate(zip(ours, ref, strict=True), 1):
        torch.testing.assert_close(g, g_ref, atol=3e-5, rtol=1e-4, msg=f"g at step {k}")
        torch.testing.assert_close(logits, logits_ref, atol=3e-5, rtol=1e-4,
                                   msg=f"logits at step {k}")


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_drafter_matches_reference_and_loads_only_its_layers(tmp_path, family):
    """Two modules, three chained steps: dense, then two sequences packed in two chunks
    each through the paged MTP cache. Resident parameters: embedding, head, MTP layers."""
    hf, t = write_with_mtp(tmp_path, family, num_layers=2)
    cfg, steps = hf.config, 3
    t = {**t, "model.embed_tokens.weight": hf.model.embed_tokens.weight,
         "lm_head.weight": hf.lm_head.weight}
    model = load_draft_model(tmp_path)
    assert model.num_modules == 2 and isinstance(model.mtp[0].block.mlp, SparseMoE)
    copies = ("embed_tokens.weight", "shared_head.head.weight")  # the NextN layer's
    resident = sum(v.numel() for k, v in t.items()
                   if not (k.startswith("model.layers.") and k.endswith(copies)))
    assert sum(v.numel() for v in model.state_dict().values()) == resident

    def ref(x, h):
        return reference_steps(t, cfg, x, h, lambda i: mtp_prefix(cfg, i), 2, steps)

    x, h = inputs(cfg, 0)
    prev, dense = h, []
    for k in range(1, steps + 1):
        prev = model.step(k, x[k: k + SEQ], prev, torch.arange(SEQ), DenseCausal(1, SEQ))
        dense.append((prev, model.logits(k, prev)))
    assert_steps_equal(dense, ref(x, h))

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
        assert_steps_equal(ours, ref(x, h))


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """family -> a quiet target with an MTP layer that guesses it often (drafts at stake)."""
    out = {}
    for family in FAMILIES:
        out[family] = tmp_path_factory.mktemp(family)
        write_with_mtp(out[family], family, agreeing=True)
    return out


@pytest.fixture(scope="module")
def plain(agreeing):
    return {f: outputs(verifier(p), prompts(8, VOCAB, seed=5), max_tokens=16)[0]
            for f, p in agreeing.items()}


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_plain(agreeing, plain, family, k):
    """Per K: one prompt at a time, three together, then all eight in one batch."""
    draft = load_draft_model(agreeing[family])
    eng, every = verifier(agreeing[family], draft, k), prompts(8, VOCAB, seed=5)
    completions = []
    for batch in (1, 3, 8):
        tokens = []
        for i in range(0, len(every), batch):
            got, result = outputs(eng, every[i:i + batch], max_tokens=16)
            tokens += got
            completions += result.completions
        assert tokens == plain[family], (k, batch)
    stats = merged_stats(completions, k)  # drafts were at stake, at every depth
    assert stats.accepted_tokens > 0.15 * stats.draft_tokens
    assert stats.accepted_per_pos[k - 1] > 0


@pytest.mark.parametrize("mode", ["packed", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_acceptance_equals_the_offline_simulation(agreeing, family, mode):
    """DESIGN 3.5: per-position acceptance in the engine (the verifier's packed path with
    the drafter's static buffers; or the verifier's static verify buffers, what CUDA
    graphs replay, with the drafter's packed path) equals `simulate_rounds` of the same
    modules within 0.02."""
    k, every = 3, prompts(8, VOCAB, seed=7)
    draft = load_draft_model(agreeing[family])
    eng = verifier(agreeing[family], draft, k)
    if mode == "static":
        eng.graphs = VerifyGraphs(eng.model, eng.cache, eng.config.max_seqs, k,
                                  eng.config.max_len, use_graphs=False, static_on_cpu=True)
        eng.drafter.engine.runner.fits = lambda windows: False
    want = simulate_rounds(eng.model, draft, every, k, 16)
    got = engine_acceptance(eng, every, 16)
    assert min(want.rates) > 0.05  # drafts at stake at every position
    assert_acceptance_matches(got, want)
    assert (eng.graphs.eager_runs > 0) is (mode == "static")  # the static path ran


@pytest.mark.parametrize("family", FAMILIES)
def test_acceptance_check_fails_when_steps_read_the_target_hidden_state(agreeing, family):
    """The mutant: steps 2..K fed h instead of g[k-1] against the chained simulation."""
    k, every = 3, prompts(8, VOCAB, seed=7)
    draft = load_draft_model(agreeing[family])
    kv = KVBudget(block_size=BLOCK)
    eng = engine(load_target(agreeing[family]), draft, k=k, chain=False, chunk=5, kv=kv,
                 drafter_kv=kv)
    want = simulate_rounds(eng.model, draft, every, k, 16)
    assert max(rate_gaps(engine_acceptance(eng, every, 16), want)) > TOLERANCE


# The releases' shapes (hub config.json fields), built on the meta device: parameter
# counts as published (GLM-4.5-Air 106B, Qwen3-30B-A3B 30.5B), and a drafter of the
# embedding, head and one MoE MTP layer only.
HUB = {
    "GLM-4.5-Air": ({"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True,
                     "first_k_dense_replace": 1, "head_dim": 128, "hidden_size": 4096,
                     "intermediate_size": 10944, "max_position_embeddings": 131072,
                     "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
                     "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
                     "num_experts_per_tok": 8, "num_hidden_layers": 46,
                     "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
                     "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
                     "rope_theta": 1000000, "routed_scaling_factor": 1.0,
                     "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False,
                     "vocab_size": 151552}, 106.0e9, 107.5e9),
    "Qwen3-30B-A3B": ({"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1,
                       "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144,
                       "max_position_embeddings": 40960, "mlp_only_layers": [],
                       "moe_intermediate_size": 768, "norm_topk_prob": True,
                       "num_attention_heads": 32, "num_experts": 128,
                       "num_experts_per_tok": 8, "num_hidden_layers": 48,
                       "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
                       "rope_theta": 1000000.0, "tie_word_embeddings": False,
                       "use_sliding_window": False, "vocab_size": 151936,
                       "num_nextn_predict_layers": 1}, 30.3e9, 30.7e9),
}


@pytest.mark.parametrize("release", HUB)
def test_hub_configs_build_at_the_published_size(release):
    hf, low, high = HUB[release]
    cfg = ModelConfig.from_hf(hf)
    family = family_for(cfg.architecture)
    with torch.device("meta"):
        target = TargetModel(cfg, 64)
        draft = MTPDraftModel(cfg, 1, family.mtp.glue, 64, family.mtp_block)
    assert low < sum(p.numel() for p in target.parameters()) < high
    layer = sum(p.numel() for p in draft.mtp.parameters())
    assert isinstance(draft.mtp[0].block.mlp, SparseMoE)
    moe_layer = sum(p.numel() for p in target.model.layers[-1].parameters())
    assert moe_layer < layer < moe_layer + 3 * cfg.hidden_size ** 2  # + enorm/hnorm/eh_proj
    shared = 2 * cfg.vocab_size * cfg.hidden_size
    assert sum(p.numel() for p in draft.parameters()) == shared + layer


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_train_mtp_modules_load_back_in_the_family_layout(tmp_path, family):
    """`train-mtp`'s output: the family's MoE block at model.layers.{N+i}, loaded by
    `load_draft_model` into the same drafter that was trained. The GLM target declares
    one NextN layer and ships none (transformers' default config; quantized releases
    drop layer N the same way): it serves plainly, saying why, and gets modules."""
    target_dir, out = tmp_path / "target", tmp_path / "out"
    declared = {"glm4_moe": 1, "qwen3_moe": 0}[family]
    write_target(target_dir, family, num_nextn_predict_layers=declared)
    why = "holds none of their weights" if declared else "declares no MTP modules"
    assert why in no_mtp_reason(target_dir)
    trained = TargetWithMTP(load_target(target_dir), 2)
    trained.init_mtp(seed=3, std=0.3)
    write_folder(trained, target_dir, out, copy=False)
    names = set(load_file(str(out / "mtp.safetensors")))
    assert "model.layers.4.mlp.experts.gate_up_proj" in names  # N + 1, N = 3
    draft = load_draft_model(out)
    assert draft.num_modules == 2 and isinstance(draft.mtp[1].block.mlp, SparseMoE)
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


def rewrite_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))


def one_line_error(call) -> str:
    with pytest.raises(CheckpointError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_and_misshaped_mtp_tensors_are_named(tmp_path, family):
    write_with_mtp(tmp_path, family)
    missing = "model.layers.3.mlp.experts.5.up_proj.weight"
    rewrite_mtp(tmp_path, lambda t: t.pop(missing))
    assert missing in one_line_error(lambda: load_draft_model(tmp_path))
    write_with_mtp(tmp_path, family)
    bad = "model.layers.3.mlp.gate.weight"
    rewrite_mtp(tmp_path, lambda t: t.update({bad: t[bad][:-1].clone()}))
    msg = one_line_error(lambda: load_draft_model(tmp_path))
    assert bad in msg and "shape" in msg


UNSUPPORTED = {
    "glm4_moe": [({"scoring_func": "softmax"}, "scoring_func"),
                 ({"topk_method": "greedy"}, "topk_method"),
                 ({"moe_layer_freq": 2}, "moe_layer_freq"),
                 ({"hidden_act": "gelu"}, "hidden_act")],
    "qwen3_moe": [({"scoring_func": "sigmoid"}, "scoring_func"),
                  ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                  ({"use_sliding_window": True}, "use_sliding_window")],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_unsupported_router_or_layer_pattern_is_named(tmp_path, family):
    write_target(tmp_path, family)
    original = (tmp_path / "config.json").read_text()
    for fields, name in UNSUPPORTED[family]:
        (tmp_path / "config.json").write_text(original)
        rewrite_config(tmp_path, **fields)
        assert name in one_line_error(lambda: load_target(tmp_path)), fields

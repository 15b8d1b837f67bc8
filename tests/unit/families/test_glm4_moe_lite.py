"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`: MLA + MoE by `mlp_layer_types`) and its NextN
MTP layer at model.layers.{N}, against transformers and a plainly written reference.

- Target logits equal transformers' at every position (fp32) through the latent paged
  cache and DenseCausal (layer 0 dense, 1-2 MoE: 8 experts in 4 groups, topk_group 2,
  top-2, a shared expert, scaling 1.8); the default pattern (no `mlp_layer_types`) too.
- Routing decisions of every MoE layer equal transformers' router, ties included.
- Greedy plain decoding equals transformers' `generate`.
- The NextN layer (MLA + MoE, experts per expert) loads through `load_draft_model`,
  matches the family's equations written plainly, and greedy speculative output equals
  plain at K = 1..4, batch 1/3/8; engine acceptance equals the offline simulation;
  `train-mtp` modules (MoE blocks) load back in that layout and are lossless.
- An unsupported layer pattern, router or rotary width, or a missing NextN expert
  tensor, fails with one line naming it.
"""

from __future__ import annotations

import json

import pytest
import torch

from chainspec.engine.runner import merged_stats
from chainspec.models.attention import DenseCausal
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.moe import SparseMoE
from chainspec.training.evaluate import simulate_rounds
from tests.acceptance_audit import assert_acceptance_matches, engine_acceptance
from tests.unit.engine_fixtures import outputs, prompts
from tests.unit.families.glm4_moe_lite_checkpoint import write_target, write_with_mtp
from tests.unit.families.test_deepseek_v3 import (
    SEQ,
    VOCAB,
    assert_steps_equal,
    inputs,
    one_line_error,
    packed_logits,
    random_ids,
    rewrite_mtp,
    verifier,
)
from tests.unit.families.test_deepseek_v3_moe import (
    assert_routing_equals_transformers,
    assert_train_mtp_modules_load_back,
    reference_steps,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm4_moe_lite")
    hf, tensors = write_with_mtp(path)
    return path, hf, tensors


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """Quiet and agreeing; scaling 1 so the MoE layers do not drown the last token (seed
    2: about 0.55 / 0.27 / 0.19 of drafts accepted at depths 1-3; seed 0 only 0.01 at 3)."""
    path = tmp_path_factory.mktemp("glm4_moe_lite_agreeing")
    write_with_mtp(path, seed=2, agreeing=True, routed_scaling_factor=1.0)
    return path


@pytest.mark.parametrize("pattern", ["explicit", "default"])
@torch.no_grad()
def test_logits_match_transformers(tmp_path, pattern):
    """`default`: no mlp_layer_types in config.json (transformers: layer 0 dense)."""
    types = ["sparse", "dense", "sparse"] if pattern == "explicit" else None
    hf, _ = write_with_mtp(tmp_path, mlp_layer_types=types)
    if pattern == "default":
        cfg = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(
            {k: v for k, v in cfg.items() if k != "mlp_layer_types"}))
    model = load_target(tmp_path)
    want_sparse = [t == "sparse" for t in hf.config.mlp_layer_types]
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == want_sparse
    ids = random_ids()
    want = {s: hf(input_ids=t[None]).logits[0] for s, t in ids.items()}
    paged = packed_logits(model, ids)
    for s, t in ids.items():
        dense = model.logits(model(t, torch.arange(len(t)), DenseCausal(1, len(t))))
        assert want[s].abs().max() > 1.0
        torch.testing.assert_close(paged[s], want[s], atol=1e-4, rtol=1e-5, msg=f"paged {s}")
        torch.testing.assert_close(dense, want[s], atol=1e-4, rtol=1e-5, msg=f"dense {s}")


@torch.no_grad()
def test_routing_equals_transformers_in_every_moe_layer(checkpoint):
    path, hf, _ = checkpoint
    assert_routing_equals_transformers(load_target(path), hf)


def test_greedy_generation_equals_transformers(checkpoint):
    path, hf, _ = checkpoint
    batch = prompts(3, VOCAB, seed=3)
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
    assert isinstance(draft.mtp[0].block.mlp, SparseMoE)
    eng, every = verifier(agreeing, draft, k), prompts(8, VOCAB, seed=5)
    tokens, completions = [], []
    for i in range(0, len(every), batch):
        got, result = outputs(eng, every[i:i + batch], max_tokens=16)
        tokens += got
        completions += result.completions
    assert tokens == plain
    stats = merged_stats(completions, k)
    assert stats.accepted_tokens > 0.15 * stats.draft_tokens
    assert stats.accepted_per_pos[k - 1] > 0


def test_acceptance_equals_the_offline_simulation(agreeing):
    k, every = 3, prompts(8, VOCAB, seed=7)
    draft = load_draft_model(agreeing)
    eng = verifier(agreeing, draft, k)
    want = simulate_rounds(eng.model, draft, every, k, 16)
    assert min(want.rates) > 0.05
    assert_acceptance_matches(engine_acceptance(eng, every, 16), want)


@torch.no_grad()
def test_drafter_matches_reference(checkpoint):
    path, hf, t = checkpoint
    model = load_draft_model(path)
    x, h = inputs(hf.config, 0)
    prev, ours = h, []
    for k in (1, 2, 3):
        prev = model.step(k, x[k: k + SEQ], prev, torch.arange(SEQ), DenseCausal(1, SEQ))
        ours.append((prev, model.logits(k, prev)))
    assert_steps_equal(ours, reference_steps(t, hf.config, x, h, 3))


def test_train_mtp_modules_load_back_in_the_family_layout(tmp_path):
    target_dir = tmp_path / "target"
    write_target(target_dir, num_nextn_predict_layers=0)
    assert_train_mtp_modules_load_back(target_dir, tmp_path / "out")


# --- errors -------------------------------------------------------------------------------

def edit_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("field, value, named", [
    ("mlp_layer_types", ["dense", "sparse"], "mlp_layer_types"),
    ("mlp_layer_types", ["dense", "moe", "sparse"], "'moe'"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
])
def test_unsupported_pattern_router_or_rotary_is_named(tmp_path, field, value, named):
    write_with_mtp(tmp_path)
    edit_config(tmp_path, **{field: value})
    for load in (load_target, load_draft_model):
        assert named in one_line_error(lambda load=load: load(tmp_path))


def test_missing_expert_tensor_of_the_nextn_layer_is_named(tmp_path):
    write_with_mtp(tmp_path)
    name = "model.layers.3.mlp.experts.7.down_proj.weight"
    rewrite_mtp(tmp_path, lambda t: t.pop(name))
    assert name in one_line_error(lambda: load_draft_model(tmp_path))

"""DeepSeek-V3 with MoE layers (MLA + sigmoid-routed, group-limited MoE), and its MoE MTP
layer at model.layers.{N}, against transformers and a plainly written reference.

- Target logits equal `DeepseekV3ForCausalLM`'s at every position (fp32) through the
  engine's latent paged cache and DenseCausal, with layer 0 dense and layer 1 MoE
  (8 experts in 4 groups, topk_group 2, top-2, one shared expert, scaling 2.5).
- Routing decisions of every MoE layer equal transformers' router on the hidden states
  that reach it, and on all-equal scores (ties broken the same way).
- Greedy plain decoding equals transformers' `generate`.
- The MoE MTP layer (experts stored per expert, the hub's layout) loads through
  `load_draft_model`, matches the family's equations written plainly (router included),
  and greedy speculative output equals plain at K = 1..4, batch 1/3/8; engine
  acceptance equals the offline simulation within 0.02; modules `train-mtp` writes for
  an MoE target (MoE blocks) load back in that layout and are lossless.
- An unsupported router or layer pattern, or a missing expert tensor, fails with one
  line naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from chainspec.engine.runner import merged_stats
from chainspec.models.attention import DenseCausal
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.moe import SparseMoE
from chainspec.training.evaluate import simulate_rounds
from chainspec.training.mtp_export import write_folder
from chainspec.training.mtp_model import TargetWithMTP
from tests.acceptance_audit import assert_acceptance_matches, engine_acceptance
from tests.unit.engine_fixtures import outputs, prompts
from tests.unit.families.deepseek_v3_checkpoint import (
    MOE,
    mtp_prefix,
    write_target,
    write_with_mtp,
)
from tests.unit.families.test_deepseek_v3 import (
    SEQ,
    VOCAB,
    assert_steps_equal,
    inputs,
    linear,
    mla,
    one_line_error,
    packed_logits,
    random_ids,
    rewrite_mtp,
    rms,
    verifier,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3_moe")
    hf, tensors = write_with_mtp(path, **MOE)
    return path, hf, tensors


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    """Quiet and agreeing (drafts at stake at every depth): scaling 1, not 2.5, or the
    MoE layers' share of the residual stream drowns the last token's."""
    path = tmp_path_factory.mktemp("deepseek_v3_moe_agreeing")
    write_with_mtp(path, agreeing=True, **{**MOE, "routed_scaling_factor": 1.0})
    return path


@torch.no_grad()
def test_logits_match_transformers(checkpoint):
    path, hf, _ = checkpoint
    model = load_target(path)
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [False, True]
    ids = random_ids()
    want = {s: hf(input_ids=t[None]).logits[0] for s, t in ids.items()}
    paged = packed_logits(model, ids)
    for s, t in ids.items():
        dense = model.logits(model(t, torch.arange(len(t)), DenseCausal(1, len(t))))
        assert want[s].abs().max() > 1.0
        torch.testing.assert_close(paged[s], want[s], atol=1e-4, rtol=1e-5, msg=f"paged {s}")
        torch.testing.assert_close(dense, want[s], atol=1e-4, rtol=1e-5, msg=f"dense {s}")


def gate_inputs(module, run):
    """The hidden states that reach `module` (a router) during `run()`."""
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        run()
    finally:
        handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


@torch.no_grad()
def test_routing_equals_transformers_in_every_moe_layer(checkpoint):
    path, hf, _ = checkpoint
    assert_routing_equals_transformers(load_target(path), hf)


def assert_routing_equals_transformers(model, hf):
    """Every MoE layer's router: the hidden states reaching it equal transformers', and
    its choices (order included) and weights equal transformers' router's on them, and
    on all-equal scores (ties)."""
    ids, checked = random_ids()["b"], 0
    for i, ours in enumerate(model.model.layers):
        if not isinstance(ours.mlp, SparseMoE):
            continue
        theirs = hf.model.layers[i].mlp.gate
        x_ours = gate_inputs(ours.mlp.gate, lambda: model(ids, torch.arange(len(ids)),
                                                          DenseCausal(1, len(ids))))
        x_hf = gate_inputs(theirs, lambda: hf(input_ids=ids[None]))
        torch.testing.assert_close(x_ours, x_hf, atol=1e-5, rtol=1e-5)
        _, w_hf, ids_hf = theirs(x_hf)
        got_ids, got_w = ours.mlp.gate(x_hf)
        assert torch.equal(got_ids, ids_hf), f"layer {i}"
        torch.testing.assert_close(got_w, w_hf, msg=f"layer {i}")
        assert len(set(ids_hf.flatten().tolist())) > 2  # many experts chosen: routing shows
        # ties: a zero correction bias and zero rows make every score 0.5
        biases = [g.e_score_correction_bias for g in (theirs, ours.mlp.gate)]
        kept = [b.clone() for b in biases]
        try:
            for b in biases:
                b.zero_()
            zeros = torch.zeros(3, x_hf.shape[1])
            assert torch.equal(ours.mlp.gate(zeros)[0], theirs(zeros)[2])
        finally:
            for b, k in zip(biases, kept, strict=True):
                b.copy_(k)
        checked += 1
    assert checked > 0


def test_greedy_generation_equals_transformers(checkpoint):
    path, hf, _ = checkpoint
    batch = prompts(3, VOCAB, seed=3)  # lengths over chunks of 5, blocks of 4
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


# --- the MoE MTP equations, written plainly from the checkpoint tensors -------------------

def swiglu(t, p, x, e=None):
    gate, up, down = (f"{p}{e}.{n}_proj" if e is not None else f"{p}{n}_proj"
                      for n in ("gate", "up", "down"))
    g = linear(t, gate, x)
    return linear(t, down, g * torch.sigmoid(g) * linear(t, up, x))


def moe_reference(t, p, cfg, x):
    """Per row: s = sigmoid(W x); keep the topk_group groups whose two best s + bias sum
    highest; the top-k of s + bias among them; weights s / sum(s) * scale."""
    scores = torch.sigmoid(x @ t[p + "gate.weight"].T)
    choice = scores + t[p + "gate.e_score_correction_bias"]
    per_group = cfg.n_routed_experts // cfg.n_group
    out = swiglu(t, p + "shared_experts.", x)
    for row in range(len(x)):
        groups = choice[row].view(cfg.n_group, per_group)
        best = groups.topk(2).values.sum(-1).topk(cfg.topk_group).indices.tolist()
        allowed = [e for e in range(cfg.n_routed_experts) if e // per_group in best]
        chosen = sorted(allowed, key=lambda e: -choice[row, e].item())[:cfg.num_experts_per_tok]
        weights = scores[row, chosen] / scores[row, chosen].sum() * cfg.routed_scaling_factor
        for e, w in zip(chosen, weights, strict=True):
            out[row] += w * swiglu(t, p + "experts.", x[row:row + 1], e)[0]
    return out


def moe_block(t, p, cfg, x, positions):
    eps = cfg.rms_norm_eps
    x = x + mla(t, p, cfg, rms(x, t[p + "input_layernorm.weight"], eps), positions)
    return x + moe_reference(t, p + "mlp.", cfg, rms(x, t[p + "post_attention_layernorm.weight"],
                                                     eps))


def reference_steps(t, cfg, x, h, num_steps):
    eps, positions, prev, out = cfg.rms_norm_eps, torch.arange(len(h)), h, []
    p = mtp_prefix(cfg, 0)
    for k in range(1, num_steps + 1):
        e = rms(t[p + "embed_tokens.weight"][x[k: k + len(h)]], t[p + "enorm.weight"], eps)
        u = torch.cat([e, rms(prev, t[p + "hnorm.weight"], eps)], -1)
        g = moe_block(t, p, cfg, u @ t[p + "eh_proj.weight"].T, positions)
        out.append((g, rms(g, t[p + "shared_head.norm.weight"], eps)
                    @ t[p + "shared_head.head.weight"].T))
        prev = g
    return out


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


@torch.no_grad()
def assert_train_mtp_modules_load_back(target_dir, out, modules: int = 2):
    """`train-mtp`'s output for an MoE target (fresh modules, as training starts): MoE
    MTP blocks written in the family layout at model.layers.{N+i}, loaded by
    `load_draft_model` into the same drafter, and lossless in the engine."""
    trained = TargetWithMTP(load_target(target_dir), modules)
    trained.init_mtp(seed=3, std=0.3)
    write_folder(trained, target_dir, out, copy=False)
    draft = load_draft_model(out)
    n = trained.config.num_layers
    assert draft.num_modules == modules
    assert all(isinstance(m.block.mlp, SparseMoE) for m in draft.mtp)
    names = load_file(str(out / "mtp.safetensors"))  # experts stacked (fused layout)
    last = f"model.layers.{n + modules - 1}.mlp."
    assert {last + "gate.e_score_correction_bias", last + "experts.gate_up_proj"} <= set(names)
    x, h = inputs(trained.config, 0)
    ours, theirs = h, h
    for k in range(1, modules + 1):
        ours = draft.step(k, x[k: k + SEQ], ours, torch.arange(SEQ), DenseCausal(1, SEQ))
        theirs = trained.draft.step(k, x[k: k + SEQ], theirs, torch.arange(SEQ),
                                    DenseCausal(1, SEQ))
        torch.testing.assert_close(draft.logits(k, ours), trained.draft.logits(k, theirs))
    batch = prompts(3, VOCAB, seed=9)
    plain_tokens = outputs(verifier(target_dir), batch, max_tokens=10)[0]
    for k in (1, 3):
        got = outputs(verifier(target_dir, draft, k), batch, max_tokens=10)[0]
        assert got == plain_tokens, f"K={k}"


def test_train_mtp_modules_load_back_in_the_family_layout(tmp_path):
    target_dir = tmp_path / "target"
    write_target(target_dir, num_nextn_predict_layers=0, **MOE)
    assert_train_mtp_modules_load_back(target_dir, tmp_path / "out")


# --- errors -------------------------------------------------------------------------------

def edit_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("field, value", [("topk_method", "group_limited_greedy"),
                                          ("scoring_func", "softmax"),
                                          ("moe_layer_freq", 2)])
def test_unsupported_router_or_pattern_is_named(tmp_path, field, value):
    write_with_mtp(tmp_path, **MOE)
    edit_config(tmp_path, **{field: value})
    for load in (load_target, load_draft_model):
        msg = one_line_error(lambda load=load: load(tmp_path))
        assert field in msg and str(value) in msg


def test_missing_expert_tensor_of_the_mtp_layer_is_named(tmp_path):
    write_with_mtp(tmp_path, **MOE)
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite_mtp(tmp_path, lambda t: t.pop(name))
    assert name in one_line_error(lambda: load_draft_model(tmp_path))
    load_target(tmp_path)  # the MTP layer's experts are not the target's

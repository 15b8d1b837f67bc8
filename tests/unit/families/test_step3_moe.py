"""Step-3.5-Flash with MoE layers (transformers' `Step3p7SparseMoeBlock`: sigmoid router
with correction bias normalised by the plain sum, routed experts clamped by
`swiglu_limits`, scaled after the experts, one clamped shared expert), loaded from the
hub's `moe.*` / `share_expert.*` layout: logits equal transformers' through DenseCausal and
the paged cache; every sparse layer's routing equals transformers' on the hidden states
transformers feeds it; the clamp and the late scale both matter; the hub's config spelling
parses alike; greedy plain equals transformers' cached greedy loop (test_step3_engine's);
the chained dense MTP layers draft losslessly at K = 1..4, batch 1/3/8; unsupported
routers and missing or mis-shaped expert tensors fail in one line naming them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from chainspec.models.config import ModelConfig, read_hf_config
from chainspec.models.errors import CheckpointError
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.moe import SparseMoE
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families.step3_checkpoint import NUM_MTP, mtp_shapes
from tests.unit.families.step3_moe_checkpoint import MOE, write_checkpoint, write_target
from tests.unit.families.test_step3_engine import (
    BLOCKS,
    CHUNK,
    MAX_TOKENS,
    VOCAB,
    hf_greedy,
    prompts,
)
from tests.unit.families.test_step3_target import dense, ids, packed_logits


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("step3_moe")
    return write_target(path, seed=3), path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("step3_moe_engine")
    hf = write_checkpoint(path, seed=5, vocab_size=VOCAB)
    return hf, load_target(path), load_draft_model(path)


@pytest.fixture(scope="module")
def plain(models):
    return outputs(engine(models[1], chunk=CHUNK, kv=BLOCKS), prompts(8), MAX_TOKENS)[0]


@torch.no_grad()
def test_logits_match_transformers_packed_paged_and_dense(checkpoint):
    hf, path = checkpoint
    model = load_target(path)
    mlps = [layer.mlp for layer in model.model.layers]
    assert [isinstance(m, SparseMoE) for m in mlps] == [False, True, True, True]
    assert [m.cfg.expert_limit for m in mlps[1:]] == [None, 0.05, None]
    assert mlps[2].shared_experts.limit == 0.4  # swiglu_limits_shared
    seqs = ids()
    got = packed_logits(model, seqs)
    for s, x in seqs.items():
        want = hf(x[None])[0][0]
        torch.testing.assert_close(got[s], want, atol=1e-4, rtol=1e-5, msg=f"paged {s}")
        torch.testing.assert_close(dense(model, x), want, atol=1e-4, rtol=1e-5, msg=s)


@torch.no_grad()
def test_routing_equals_transformers_in_every_sparse_layer(checkpoint):
    hf, path = checkpoint
    model = load_target(path)
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(hf.model.layers) if i > 0]
    hf(ids()["a"][None])
    for h in hooks:
        h.remove()
    assert sorted(seen) == [1, 2, 3]
    for i, x in seen.items():
        _, want_w, want_ids = hf.model.layers[i].mlp.gate(x)
        got_ids, got_w = model.model.layers[i].mlp.gate(x)
        assert torch.equal(got_ids, want_ids), i
        assert torch.equal(got_w, want_w.float()), i
        assert len(set(got_ids.flatten().tolist())) > 4, i  # routes spread


@torch.no_grad()
def test_ties_break_as_transformers_breaks_them(checkpoint):
    """Experts 1, 4, 6 given one router row and bias: bit-identical scores."""
    hf, path = checkpoint
    ours = load_target(path).model.layers[1].mlp.gate
    theirs = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        for gate in (ours, theirs):
            gate.weight[[4, 6]] = gate.weight[1].clone()
            gate.e_score_correction_bias[[4, 6]] = gate.e_score_correction_bias[1].clone()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(4))
    got_ids, got_w = ours(x)
    _, want_w, want_ids = theirs(x)
    hits = torch.isin(got_ids, torch.tensor([1, 4, 6])).sum(-1)  # [64] tied experts chosen
    assert ((hits == 1) | (hits == 2)).sum() > 5  # the top-k boundary fell inside the tie
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w.float())


@torch.no_grad()
def test_expert_clamp_and_late_scale_both_matter(checkpoint):
    hf, path = checkpoint
    x = ids()["a"]
    want = hf(x[None])[0][0]
    for change in ({"expert_limit": None}, {"output_scale": 1.0}):
        model = load_target(path)
        for layer in model.model.layers[1:]:
            layer.mlp.cfg = dataclasses.replace(layer.mlp.cfg, **change)
            layer.mlp.experts.limit = layer.mlp.cfg.expert_limit
        assert (dense(model, x) - want).abs().max() > 1e-2, change


def test_the_hubs_config_spelling_parses_to_the_same_model(checkpoint):
    """`moe_num_experts`, `moe_top_k`, `moe_layers_enum` and `swiglu_limits` padded with
    the MTP layers' entries, as the hub's config.json spells them."""
    _, path = checkpoint
    cfg = read_hf_config(path)
    hub = {k: v for k, v in cfg.items() if k not in (
        "n_routed_experts", "num_experts_per_tok", "mlp_layer_types", "mtp_mlp_layer_types",
        "swiglu_limits")}
    hub.update(moe_num_experts=8, moe_top_k=2, moe_layers_enum=MOE["moe_layers_enum"],
               swiglu_limits=MOE["swiglu_limits"], moe_router_activation="sigmoid",
               use_moe_router_bias=True)
    assert len(hub["swiglu_limits"]) == cfg["num_hidden_layers"] + NUM_MTP
    assert ModelConfig.from_hf(hub) == ModelConfig.from_hf(cfg)


def test_the_drafter_holds_no_target_expert(models):
    """The drafter loads the embedding, the head and its (dense) MTP layers only."""
    hf, _, draft = models
    assert not [n for n, _ in draft.named_parameters() if "experts" in n or ".gate." in n]
    mtp = sum(math.prod(shape) for shape in mtp_shapes(hf.config).values())
    shared = hf.config.vocab_size * hf.config.hidden_size  # the embedding, the head
    assert sum(p.numel() for p in draft.parameters()) == mtp + 2 * shared


def test_greedy_plain_equals_transformers(models, plain):
    hf = models[0]
    for prompt, got in zip(prompts(8), plain, strict=True):
        assert got == hf_greedy(hf, prompt, MAX_TOKENS)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_speculative_with_the_chained_mtp_drafter_equals_plain(models, plain, k, batch):
    _, target, draft = models
    eng = engine(target, draft, k=k, chain=True, chunk=CHUNK, kv=BLOCKS, drafter_kv=BLOCKS,
                 sampled_drafts=False)
    got, accepted = [], 0
    ps = prompts(8)
    for i in range(0, 8, batch):
        tokens, result = outputs(eng, ps[i:i + batch], max_tokens=MAX_TOKENS)
        got += tokens
        accepted += sum(c.stats.accepted_tokens for c in result.completions)
    assert got == plain
    assert accepted > 0  # the drafter ran and some drafts were kept


def _edit_config(path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("fields, words", [
    ({"moe_router_activation": "softmax"}, "unsupported router moe_router_activation="
                                           "'softmax'"),
    ({"use_moe_router_bias": False}, "unsupported router use_moe_router_bias=false"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in 1..8"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]},
     "unsupported mlp_layer_types ['moe']"),
    ({"mlp_layer_types": None, "mtp_mlp_layer_types": None, "moe_layers_enum": "1,x"},
     "unsupported moe_layers_enum '1,x'"),
])
def test_unsupported_router_fails_in_one_line_naming_it(tmp_path, fields, words):
    write_target(tmp_path, seed=1)
    _edit_config(tmp_path, **fields)
    with pytest.raises(CheckpointError, match="config.json") as e:
        load_target(tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage, name", [
    ("drop", "model.layers.3.moe.up_proj.weight"),
    ("drop", "model.layers.1.moe.router_bias"),
    ("drop", "model.layers.2.share_expert.down_proj.weight"),
    ("reshape", "model.layers.2.moe.gate_proj.weight"),
])
def test_a_missing_or_misshaped_expert_tensor_is_named(tmp_path, damage, name):
    write_target(tmp_path, seed=1)
    state = load_file(str(tmp_path / "model.safetensors"))
    if damage == "drop":
        del state[name]
    else:
        state[name] = state[name][:, :-1].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_target(tmp_path)
    assert name in str(e.value) and "\n" not in str(e.value)

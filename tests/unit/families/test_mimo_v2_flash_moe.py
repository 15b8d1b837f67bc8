"""MiMo-V2-Flash with sparse layers (transformers' `MiMoV2FlashMoE`: sigmoid router with
correction bias, group-limited top-k, routed scaling, no shared experts) against
transformers: logits equal through DenseCausal and the paged cache; every sparse layer's
routing decisions equal transformers' on the hidden states transformers feeds it; greedy
plain decoding equals transformers' cached greedy loop (as test_mimo_v2_flash_engine, whose
helpers this reuses); the dense MTP layers (hub layout) draft losslessly at K = 1..4,
batch 1/3/8; unsupported routers and missing experts fail in one line naming them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from chainspec.models.attention import DenseCausal
from chainspec.models.errors import CheckpointError
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.moe import SparseMoE, route
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families.mimo_v2_flash_checkpoint import mtp_shapes
from tests.unit.families.mimo_v2_flash_moe_checkpoint import write_checkpoint, write_target
from tests.unit.families.test_mimo_v2_flash_engine import (
    BLOCKS,
    CHUNK,
    MAX_TOKENS,
    VOCAB,
    hf_greedy,
    prompts,
)
from tests.unit.families.test_mimo_v2_flash_target import ids, packed_logits


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_v2_flash_moe")
    return write_target(path, seed=3), path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_v2_flash_moe_engine")
    hf = write_checkpoint(path, seed=5, vocab_size=VOCAB)
    return hf, load_target(path), load_draft_model(path)


@pytest.fixture(scope="module")
def plain(models):
    return outputs(engine(models[1], chunk=CHUNK, kv=BLOCKS), prompts(8), MAX_TOKENS)[0]


@torch.no_grad()
def test_logits_match_transformers_packed_paged_and_dense(checkpoint):
    hf, path = checkpoint
    model = load_target(path)
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers]
    assert sparse == [False, True, True, True]
    assert not hasattr(model.model.layers[1].mlp, "shared_experts")
    seqs = ids()
    got = packed_logits(model, seqs)
    for s, x in seqs.items():
        want = hf(input_ids=x[None]).logits[0]
        torch.testing.assert_close(got[s], want, atol=1e-4, rtol=1e-5, msg=f"paged {s}")
        dense = model.logits(model(x, torch.arange(len(x)), DenseCausal(1, len(x))))
        torch.testing.assert_close(dense, want, atol=1e-4, rtol=1e-5, msg=f"dense {s}")


@torch.no_grad()
def test_routing_equals_transformers_in_every_sparse_layer(checkpoint):
    """The hidden states transformers' own MoE blocks see, through our layers' routers."""
    hf, path = checkpoint
    model = load_target(path)
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(hf.model.layers) if i > 0]
    hf(input_ids=ids()["a"][None])
    for h in hooks:
        h.remove()
    assert sorted(seen) == [1, 2, 3]
    chosen = set()
    for i, x in seen.items():
        _, want_w, want_ids = hf.model.layers[i].mlp.gate(x)
        got_ids, got_w = model.model.layers[i].mlp.gate(x)
        assert torch.equal(got_ids, want_ids), i
        assert torch.equal(got_w, want_w.float()), i
        chosen |= set(got_ids.flatten().tolist())
        gate = model.model.layers[i].mlp.gate
        for change in ({"n_group": 1, "topk_group": 1}, "no bias"):  # both bind somewhere
            cfg = gate.cfg if change == "no bias" else dataclasses.replace(gate.cfg, **change)
            bias = gate.e_score_correction_bias * (0 if change == "no bias" else 1)
            other = route(x, gate.weight, bias, cfg)[0]
            assert not torch.equal(other.sort(-1)[0], got_ids.sort(-1)[0]), (i, change)
    assert len(chosen) > 4  # routes spread over the experts


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
def test_speculative_with_the_mtp_drafter_equals_plain(models, plain, k, batch):
    _, target, draft = models
    eng = engine(target, draft, k=k, chain=False, chunk=CHUNK, kv=BLOCKS, drafter_kv=BLOCKS,
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
    ({"scoring_func": "softmax"}, "unsupported router scoring_func='softmax'"),
    ({"topk_method": "greedy"}, "unsupported router topk_method='greedy'"),
    ({"n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
    ({"n_routed_experts": None}, "mlp_layer_types 'sparse' without n_routed_experts"),
])
def test_unsupported_router_fails_in_one_line_naming_it(tmp_path, fields, words):
    write_target(tmp_path, seed=1)
    _edit_config(tmp_path, **fields)
    with pytest.raises(CheckpointError, match="config.json") as e:
        load_target(tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    write_target(tmp_path, seed=1)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor "
                       "model.layers.2.mlp.experts.5.up_proj.weight") as e:
        load_target(tmp_path)
    assert "\n" not in str(e.value)


@torch.no_grad()
def test_bf16_load_keeps_the_router_in_fp32_and_routes_as_transformers(checkpoint):
    """transformers keeps `mlp.gate.weight` (and the bias) fp32 for this family; so do we,
    and routing on the bf16 hidden states its bf16 model feeds its MoE blocks is equal."""
    from transformers import MiMoV2FlashForCausalLM
    _, path = checkpoint
    hf = MiMoV2FlashForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    model = load_target(path, dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    seen: dict[int, torch.Tensor] = {}
    for i in (1, 2, 3):
        hf.model.layers[i].mlp.register_forward_pre_hook(
            lambda _m, args, i=i: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
    hf(input_ids=ids()["a"][None])
    for i, x in seen.items():
        assert x.dtype == torch.bfloat16
        _, want_w, want_ids = hf.model.layers[i].mlp.gate(x)
        got_ids, got_w = model.model.layers[i].mlp.gate(x)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w.float()), i

"""Qwen3-Next and Qwen3.5-MoE targets (Gated DeltaNet + gated full attention + MoE): logits
equal transformers' at every position, densely and through the engine's paged cache with
recurrent-state slots; routing decisions through each family's real layers equal
transformers' on the same hidden states; the GDN state after a partially accepted verify
window is that of a model that decoded only the accepted tokens (DESIGN 4.9)."""

from __future__ import annotations

import json

import pytest
import torch

from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.cache_spec import StateSpec
from chainspec.models.config import ModelConfig
from chainspec.models.families.qwen3_next import FusedGatedDeltaNet
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_target
from chainspec.models.moe import SparseMoE
from tests.unit.families.qwen3_next_checkpoint import SHAPE, hf_config, write_checkpoint

FAMILIES = ["qwen3_next", "qwen3_5_moe"]
BLOCK = 4
TABLES = {"a": [5, 0, 7, 9], "b": [1, 8, 3, 10], "c": [6, 2, 4, 11]}
SLOTS = {"a": 2, "b": 0, "c": 1}
LENGTHS = {"a": 13, "b": 11, "c": 7}
# rows [lo, hi) per sequence per step; True: a verify window (state kept after every row)
SCHEDULE = [
    {"a": (0, 6, False), "b": (0, 4, False), "c": (0, 1, False)},
    {"a": (6, 11, True), "b": (4, 11, False), "c": (1, 3, True)},
    {"a": (11, 12, False), "c": (3, 7, True)},
    {"a": (12, 13, True)},
]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, write_checkpoint(request.param, path), load_target(path)


def new_cache(model, slots: int = 3, rows: int = 5) -> ModelKVCache:
    return ModelKVCache(model.cache_specs(), {None: 12}, BLOCK, slots, rows)


def step(model, cache, seqs: dict[str, tuple[int, int, bool]], src: dict[str, int],
         ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One packed forward; updates `src` as if every row were accepted."""
    rows = [SeqRows(TABLES[s], lo, hi - lo, {}, SLOTS[s], src.get(s, -1), keep)
            for s, (lo, hi, keep) in seqs.items()]
    batch = AttnBatch.build(rows, BLOCK, with_states=True)
    tokens = torch.cat([ids[s][lo:hi] for s, (lo, hi, _) in seqs.items()])
    with torch.no_grad():
        logits = model.logits(model(tokens, batch.positions, PagedAttention(cache, batch)))
    for s, (lo, hi, keep) in seqs.items():
        src[s] = hi - lo - 1 if keep else 0
    sizes = [hi - lo for lo, hi, _ in seqs.values()]
    return dict(zip(seqs, logits.split(sizes), strict=True))


def random_ids() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {s: torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen)
            for s, n in LENGTHS.items()}


def test_layers_follow_the_family_pattern(checkpoint):
    family, _, model = checkpoint
    layers = model.model.layers
    assert [type(s).__name__ for s in model.cache_specs()] == ["StateSpec"] * 3 + ["PagedSpec"]
    assert model.cache_specs()[0] == StateSpec(((2 * 2 * 8 + 4 * 8, 3), (4, 8, 8)))
    moe = [isinstance(layer.mlp, SparseMoE) for layer in layers]
    assert moe == ([True, False, True, True] if family == "qwen3_next" else [True] * 4)
    fused = isinstance(layers[0].linear_attn, FusedGatedDeltaNet)
    assert fused == (family == "qwen3_next")
    router = layers[0].mlp.gate.cfg
    assert router.norm_topk_prob and router.top_k == 2 and router.num_experts == 4
    assert layers[0].mlp.cfg.shared_gate and layers[0].mlp.cfg.shared_name == "shared_expert"


@pytest.mark.parametrize("family,arch,want", [
    ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", True),  # transformers' router always divides
    ("qwen3_next", "Qwen3NextForCausalLM", False),  # follows the config field
])
def test_norm_topk_prob_as_each_transformers_router_reads_it(family, arch, want):
    cfg = {**json.loads(hf_config(family).to_json_string()), "architectures": [arch],
           "norm_topk_prob": False}
    assert ModelConfig.from_hf(cfg).moe.router.norm_topk_prob is want


def test_dense_logits_match_transformers(checkpoint):
    _, hf, model = checkpoint
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 17),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        hidden = model(ids.flatten(), torch.arange(17).repeat(3), DenseCausal(3, 17))
    got = model.logits(hidden).view(3, 17, -1)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_packed_paged_logits_match_transformers(checkpoint):
    _, hf, model = checkpoint
    ids, cache, src = random_ids(), new_cache(model), {}
    parts: dict[str, list[torch.Tensor]] = {s: [] for s in ids}
    for seqs in SCHEDULE:
        for s, logits in step(model, cache, seqs, src, ids).items():
            parts[s].append(logits)
    for s, t in ids.items():
        with torch.no_grad():
            want = hf(input_ids=t[None]).logits[0]
        torch.testing.assert_close(torch.cat(parts[s]), want, atol=1e-4, rtol=1e-4,
                                   msg=f"sequence {s}")


def test_routing_through_every_moe_layer_equals_transformers(checkpoint):
    """Each MoE layer's router, fed the hidden states transformers' own layer sees (its
    post-attention norm output), picks the same experts with the same weights, and the
    whole block's output agrees."""
    _, hf, model = checkpoint
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 23),
                        generator=torch.Generator().manual_seed(4))
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda _m, args, i=i: seen.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        hf(input_ids=ids)
    for h in hooks:
        h.remove()
    checked = 0
    for i, (theirs, ours) in enumerate(zip(hf.model.layers, model.model.layers, strict=True)):
        if not isinstance(ours.mlp, SparseMoE):
            continue
        x = seen[i]
        with torch.no_grad():
            _, want_w, want_ids = theirs.mlp.gate(x)
            got_ids, got_w = ours.mlp.gate(x)
            want_out = theirs.mlp(x[None])[0]
            got_out = ours.mlp(x)
        assert torch.equal(got_ids, want_ids), f"layer {i}"
        torch.testing.assert_close(got_w, want_w.float(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
        assert len(set(got_ids.flatten().tolist())) == 4  # every expert chosen somewhere
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("tie", ["all experts", "experts 1 and 3"])
def test_routing_ties_break_as_transformers_breaks_them(checkpoint, tie):
    _, hf, model = checkpoint
    theirs, ours = hf.model.layers[0].mlp.gate, model.model.layers[0].mlp.gate
    weight = torch.zeros_like(theirs.weight) if tie == "all experts" else theirs.weight.clone()
    weight[3] = weight[1]
    x = torch.randn(16, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(5))
    saved = (theirs.weight.data, ours.weight.data)
    theirs.weight.data, ours.weight.data = weight, weight.clone()
    try:
        with torch.no_grad():
            _, want_w, want_ids = theirs(x)
            got_ids, got_w = ours(x)
    finally:
        theirs.weight.data, ours.weight.data = saved
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w.float(), atol=0, rtol=0)


def states(cache: ModelKVCache, model, slot: int, row: int) -> list[torch.Tensor]:
    return [part[slot, row].clone() for i, spec in enumerate(model.cache_specs())
            if isinstance(spec, StateSpec) for part in cache.state(i)]


@pytest.mark.parametrize("accepted", [0, 3])
def test_state_after_a_partial_window_is_the_accepted_tokens_state(checkpoint, accepted):
    """Prompt of 9, a window x[N], d1..d4 with `accepted` drafts kept, then one more row:
    the kept state equals a fresh prefill of only the committed tokens, and so does the
    next row's output."""
    _, _, model = checkpoint
    gen = torch.Generator().manual_seed(accepted)
    ids = {"a": torch.randint(0, SHAPE["vocab_size"], (15,), generator=gen)}
    committed = 9 + accepted + 1  # prompt, x[N] and the accepted drafts
    spec, src = new_cache(model), {}
    step(model, spec, {"a": (0, 9, False)}, src, ids)
    step(model, spec, {"a": (9, 14, True)}, src, ids)  # K = 4 drafts at rows 10..13
    src["a"] = accepted  # the verifier's commit: the state after row j
    kept = states(spec, model, SLOTS["a"], accepted)
    bonus = {"a": torch.cat([ids["a"][:committed], ids["a"][14:15]])}  # a new token
    after = step(model, spec, {"a": (committed, committed + 1, False)}, src, bonus)["a"]

    fresh, fresh_src = new_cache(model), {}
    step(model, fresh, {"a": (0, committed, False)}, fresh_src, bonus)
    for got, want in zip(kept, states(fresh, model, SLOTS["a"], 0), strict=True):
        assert want.abs().max() > 0.01
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want_next = step(model, fresh, {"a": (committed, committed + 1, False)}, fresh_src,
                     bonus)["a"]
    torch.testing.assert_close(after, want_next, atol=1e-5, rtol=1e-5)

"""Qwen3.5 target (Gated DeltaNet + gated full attention): logits equal transformers' at
every position, densely and through the engine's paged cache with recurrent-state slots;
the GDN state after a partially accepted verify window is that of a model that decoded
only the accepted tokens (DESIGN 4.9); prefill in chunks equals one shot."""

from __future__ import annotations

import pytest
import torch

from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.cache_spec import StateSpec
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_target
from tests.unit.families.qwen3_5_checkpoint import SHAPE, write_checkpoint

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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    return write_checkpoint(path), load_target(path)


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


def test_cache_specs_follow_the_layer_pattern(checkpoint):
    _, model = checkpoint
    specs = model.cache_specs()
    assert [type(s).__name__ for s in specs] == ["StateSpec"] * 3 + ["PagedSpec"]
    conv_dim = 2 * 2 * 8 + 4 * 8  # q, k (2 heads of 8) and v (4 heads of 8)
    assert specs[0] == StateSpec(((conv_dim, 3), (4, 8, 8)))


def test_dense_logits_match_transformers(checkpoint):
    hf, model = checkpoint
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        hidden = model(ids.flatten(), torch.arange(17).repeat(3), DenseCausal(3, 17))
    got = model.logits(hidden).view(3, 17, -1)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_packed_paged_logits_match_transformers(checkpoint):
    hf, model = checkpoint
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


def states(cache: ModelKVCache, model, slot: int, row: int) -> list[torch.Tensor]:
    return [part[slot, row].clone() for i, spec in enumerate(model.cache_specs())
            if isinstance(spec, StateSpec) for part in cache.state(i)]


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_state_after_a_partial_window_is_the_accepted_tokens_state(checkpoint, accepted):
    """Prompt of 9, a window x[N], d1..d4 with `accepted` drafts kept, then one more row:
    the kept state equals a fresh prefill of only the committed tokens, and so does the
    next row's output."""
    _, model = checkpoint
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


def test_prefill_in_chunks_equals_one_shot(checkpoint):
    _, model = checkpoint
    ids = {"b": torch.randint(0, SHAPE["vocab_size"], (14,),
                              generator=torch.Generator().manual_seed(3))}
    whole, src = new_cache(model), {}
    one = step(model, whole, {"b": (0, 14, False)}, src, ids)["b"]
    chunked, src = new_cache(model), {}
    parts = [step(model, chunked, {"b": (lo, hi, False)}, src, ids)["b"]
             for lo, hi in [(0, 3), (3, 4), (4, 11), (11, 14)]]
    torch.testing.assert_close(torch.cat(parts), one, atol=1e-5, rtol=1e-5)
    for got, want in zip(states(chunked, model, SLOTS["b"], 0),
                         states(whole, model, SLOTS["b"], 0), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padding_rows_write_no_state_and_output_zero(checkpoint):
    """A static buffer's padding sequence (slot -1) and padding rows outside every span
    leave the pool untouched and give zero mixer output."""
    _, model = checkpoint
    cache = new_cache(model)
    layer = model.model.layers[0].linear_attn
    rows = [SeqRows(TABLES["a"], 0, 3, {}, SLOTS["a"], -1, False),
            SeqRows([0], 0, 2, {}, -1, -1, False)]
    batch = AttnBatch.build(rows, BLOCK, with_states=True)
    x = torch.randn(5, SHAPE["hidden_size"])
    with torch.no_grad():
        out = layer(x, batch.positions, PagedAttention(cache, batch))
    assert out[3:].abs().max() == 0 and out[:3].abs().max() > 0
    conv, rec = cache.state(0)
    untouched = [s for s in range(3) if s != SLOTS["a"]]
    assert conv[untouched].abs().max() == 0 and rec[untouched].abs().max() == 0
    assert rec[SLOTS["a"], 0].abs().max() > 0

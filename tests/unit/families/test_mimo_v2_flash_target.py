"""MiMo-V2-Flash target (dense MLPs) against transformers' own `MiMoV2FlashForCausalLM`:
logits equal at every position, through DenseCausal and through the paged cache with
sliding-window groups of their own (rows packed from several sequences, prefill chunks,
verify-sized windows and decode rows, past the window); configs chainspec cannot serve
yet fail with one line."""

from __future__ import annotations

import json

import pytest
import torch

from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.errors import CheckpointError
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_target
from tests.unit.families.mimo_v2_flash_checkpoint import WINDOW, write_target

BLOCK = 4
LENGTHS = {"a": 21, "b": 14, "c": 6}  # a and b run past the window of 8
# full-length and window tables: interleaved, out of order, so mix-ups show
TABLES = {"a": [5, 0, 7, 12, 9, 14], "b": [1, 8, 3, 13], "c": [6, 2]}
WINDOW_TABLES = {"a": [10, 4, 1, 12, 3, 7], "b": [0, 9, 13, 2], "c": [11, 5]}
SCHEDULE = [
    {"a": (0, 10), "b": (0, 4), "c": (0, 1)},  # prefill chunks, one row
    {"a": (10, 17), "b": (4, 13), "c": (1, 3)},  # chunks past the window
    {"a": (17, 21), "b": (13, 14), "c": (3, 6)},  # verify-sized windows, a decode row
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_v2_flash")
    return write_target(path, seed=3), path


def ids() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {s: torch.randint(0, 256, (n,), generator=gen) for s, n in LENGTHS.items()}


@torch.no_grad()
def packed_logits(model, seqs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    cache = ModelKVCache(model.cache_specs(), {None: 16, WINDOW: 16}, BLOCK)
    assert cache.windows == (WINDOW,)
    rows: dict[str, list[torch.Tensor]] = {s: [] for s in seqs}
    for step in SCHEDULE:
        batch = AttnBatch.build([SeqRows(TABLES[s], lo, hi - lo, {WINDOW: WINDOW_TABLES[s]})
                                 for s, (lo, hi) in step.items()], BLOCK, windows=(WINDOW,))
        tokens = torch.cat([seqs[s][lo:hi] for s, (lo, hi) in step.items()])
        logits = model.logits(model(tokens, batch.positions, PagedAttention(cache, batch)))
        for s, part in zip(step, logits.split([hi - lo for lo, hi in step.values()]),
                           strict=True):
            rows[s].append(part)
    return {s: torch.cat(parts) for s, parts in rows.items()}


@torch.no_grad()
def test_logits_match_transformers_packed_paged_and_dense(checkpoint):
    hf, path = checkpoint
    model = load_target(path)
    kinds = [layer.cache_spec().window for layer in model.model.layers]
    assert kinds == [None, WINDOW, WINDOW, None]
    seqs = ids()
    got = packed_logits(model, seqs)
    for s, x in seqs.items():
        want = hf(input_ids=x[None]).logits[0]
        assert want.abs().max() > 1.0
        torch.testing.assert_close(got[s], want, atol=1e-4, rtol=1e-5, msg=f"paged {s}")
        dense = model.logits(model(x, torch.arange(len(x)), DenseCausal(1, len(x))))
        torch.testing.assert_close(dense, want, atol=1e-4, rtol=1e-5, msg=f"dense {s}")


@torch.no_grad()
def test_window_sinks_and_value_scale_all_matter(checkpoint):
    """Each option changes the logits past the window (so the parity above sees them)."""
    hf, path = checkpoint
    x = ids()["a"]
    want = hf(input_ids=x[None]).logits[0]
    for change in ("window", "sinks", "value_scale"):
        model = load_target(path)
        for layer in model.model.layers:
            attn = layer.self_attn
            if change == "window" and attn.shape.window:
                attn.shape = type(attn.shape)(**{**vars(attn.shape), "window": 2 * WINDOW})
            if change == "sinks" and attn.shape.sinks:
                attn.attention_sink_bias.data.fill_(-30.0)
            if change == "value_scale":
                attn.shape = type(attn.shape)(**{**vars(attn.shape), "value_scale": 1.0})
        got = model.logits(model(x, torch.arange(len(x)), DenseCausal(1, len(x))))
        assert (got - want).abs()[WINDOW:].max() > 1e-2, change


def _edit_config(path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **fields}))


def test_a_dense_checkpoint_relabelled_sparse_fails_naming_its_tensors(tmp_path):
    """(MoE layers themselves: test_mimo_v2_flash_moe.py.)"""
    write_target(tmp_path, seed=1)
    _edit_config(tmp_path, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    with pytest.raises(CheckpointError, match="unexpected tensors model.layers.1.mlp.") as e:
        load_target(tmp_path)
    assert "\n" not in str(e.value)


def test_layer_types_of_the_wrong_length_are_refused(tmp_path):
    write_target(tmp_path, seed=1)
    _edit_config(tmp_path, layer_types=["full_attention"] * 3)
    with pytest.raises(CheckpointError, match="layer_types has 3 entries for 4 layers"):
        load_target(tmp_path)

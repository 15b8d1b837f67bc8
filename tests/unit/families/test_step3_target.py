"""Step-3.5-Flash target (dense MLPs) against transformers' own `Step3p7TextModel` + head:
logits equal at every position, through DenseCausal and through the paged cache with
sliding-window groups of their own (rows packed from several sequences, prefill chunks,
verify-sized windows and decode rows, past the window); each family option shows in the
logits; the hub's legacy config spelling parses to the same model; MoE configs fail in
one line naming the MoE layers."""

from __future__ import annotations

import json

import pytest
import torch

from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.config import ModelConfig, read_hf_config
from chainspec.models.errors import CheckpointError
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_target
from tests.unit.families.step3_checkpoint import NUM_MTP, PADDED, WINDOW, write_target

BLOCK = 4
LENGTHS = {"a": 21, "b": 14, "c": 6}  # a and b run past the window of 8
TABLES = {"a": [5, 0, 7, 12, 9, 14], "b": [1, 8, 3, 13], "c": [6, 2]}
WINDOW_TABLES = {"a": [10, 4, 1, 12, 3, 7], "b": [0, 9, 13, 2], "c": [11, 5]}
SCHEDULE = [
    {"a": (0, 10), "b": (0, 4), "c": (0, 1)},  # prefill chunks, one row
    {"a": (10, 17), "b": (4, 13), "c": (1, 3)},  # chunks past the window
    {"a": (17, 21), "b": (13, 14), "c": (3, 6)},  # verify-sized windows, a decode row
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("step3")
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


def dense(model, x: torch.Tensor) -> torch.Tensor:
    return model.logits(model(x, torch.arange(len(x)), DenseCausal(1, len(x))))


@torch.no_grad()
def test_logits_match_transformers_packed_paged_and_dense(checkpoint):
    hf, path = checkpoint
    model = load_target(path)
    specs = [layer.cache_spec() for layer in model.model.layers]
    assert [s.window for s in specs] == [None, WINDOW, WINDOW, None]
    assert [layer.self_attn.shape.num_heads for layer in model.model.layers] == [4, 6, 6, 4]
    seqs = ids()
    got = packed_logits(model, seqs)
    for s, x in seqs.items():
        want = hf(x[None])[0][0]
        assert want.abs().max() > 1.0
        torch.testing.assert_close(got[s], want, atol=1e-4, rtol=1e-5, msg=f"paged {s}")
        torch.testing.assert_close(dense(model, x), want, atol=1e-4, rtol=1e-5,
                                   msg=f"dense {s}")


@torch.no_grad()
def test_window_gate_scale_clamp_and_rope_kinds_all_matter(checkpoint):
    """Each family option changes the logits (so the parity above sees it)."""
    hf, path = checkpoint
    x = ids()["a"]
    want = hf(x[None])[0][0]
    for change in ("window", "gate", "scale", "clamp", "rope"):
        model = load_target(path)
        for layer in model.model.layers:
            attn = layer.self_attn
            if change == "window" and attn.shape.window:
                attn.shape = type(attn.shape)(**{**vars(attn.shape), "window": 4 * WINDOW})
            if change == "gate":
                attn.head_gate = False
            if change == "scale":
                attn.scale = attn.shape.head_dim ** -0.5
            if change == "clamp":
                layer.mlp.limit = None
        if change == "rope":  # every layer on the full kind's table
            for layer in model.model.layers:
                layer.self_attn.rotary = model.model.layers[0].self_attn.rotary
        got = dense(model, x)
        assert (got - want).abs()[WINDOW:].max() > 1e-2, change


def _edit_config(path, drop=(), **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **fields}.items() if k not in drop}
    (path / "config.json").write_text(json.dumps(cfg))


def test_the_hubs_legacy_config_parses_to_the_same_model(checkpoint, tmp_path):
    """The hub's spelling: per-layer lists padded with the MTP layers' entries, per-layer
    rope lists, `moe_layers_enum`, `attention_other_setting`, `num_attention_groups`."""
    _, path = checkpoint
    cfg = read_hf_config(path)
    legacy = {k: v for k, v in cfg.items() if k not in (
        "layer_types", "mtp_layer_types", "mlp_layer_types", "mtp_mlp_layer_types",
        "rope_parameters", "num_sliding_attention_heads", "per_layer_config",
        "num_key_value_heads", "swiglu_limits_shared")}
    legacy.update(PADDED, num_attention_groups=cfg["num_key_value_heads"],
                  attention_other_setting={"num_attention_heads": 6,
                                           "num_attention_groups": 2})
    assert len(legacy["layer_types"]) == cfg["num_hidden_layers"] + NUM_MTP
    assert ModelConfig.from_hf(legacy) == ModelConfig.from_hf(cfg)


def test_moe_layers_without_experts_are_refused_in_one_line_naming_them(tmp_path):
    """(MoE layers themselves: test_step3_moe.py.)"""
    write_target(tmp_path, seed=1)
    _edit_config(tmp_path, drop=("n_routed_experts",),
                 mlp_layer_types=["dense", "sparse", "sparse", "dense"])
    with pytest.raises(CheckpointError, match=r"config.json: .*MoE layers 1-2 .*without "
                       r"moe_num_experts") as e:
        load_target(tmp_path)
    assert "\n" not in str(e.value)
    _edit_config(tmp_path, drop=("mlp_layer_types", "mtp_mlp_layer_types"),
                 moe_layers_enum="0,3")  # the hub's spelling
    with pytest.raises(CheckpointError, match=r"MoE layers 0, 3 "):
        load_target(tmp_path)
    _edit_config(tmp_path, n_routed_experts=4, num_experts_per_tok=2)  # a dense checkpoint
    with pytest.raises(CheckpointError, match=r"unexpected tensors model.layers.0.mlp."):
        load_target(tmp_path)


def test_layer_types_of_the_wrong_length_are_refused(tmp_path):
    write_target(tmp_path, seed=1)
    _edit_config(tmp_path, layer_types=["full_attention"] * 3)
    with pytest.raises(CheckpointError, match="layer_types has 3 entries for 4 layers"):
        load_target(tmp_path)

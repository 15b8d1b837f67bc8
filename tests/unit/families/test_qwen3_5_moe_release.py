"""A Qwen3.5-MoE release (`Qwen3_5MoeForConditionalGeneration`, what the hub's MoE
checkpoints are): the text model at `model.language_model.*` serves with transformers'
logits at every position, the vision tower is left unread, and the release's `mtp.*`
drafter (an MoE layer) loads and drafts losslessly."""

from __future__ import annotations

import json

import pytest
import torch

from chainspec.engine.kv_budget import KVBudget
from chainspec.models.attention import DenseCausal
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.moe import SparseMoE
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families.qwen3_next_checkpoint import SHAPE, write_qwen3_5_moe_release


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_moe_release")
    return path, write_qwen3_5_moe_release(path, seed=3)


def test_release_layout_is_the_hubs(release):
    path, _ = release
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "qwen3_5_moe_text"


def test_release_logits_match_transformers_and_skip_the_vision_tower(release, caplog):
    path, hf = release
    with caplog.at_level("WARNING"):
        model = load_target(path)
    assert any("model.visual." in r.getMessage() for r in caplog.records)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 13),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = model.logits(model(ids.flatten(), torch.arange(13).repeat(2),
                                 DenseCausal(2, 13))).view(2, 13, -1)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_release_drafter_is_lossless(release):
    path, _ = release
    target, draft = load_target(path), load_draft_model(path)
    assert isinstance(draft.mtp[0].block.mlp, SparseMoE)
    kv = KVBudget(block_size=4)
    gen = torch.Generator().manual_seed(2)
    ps = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist()
          for n in (3, 9, 14)]
    plain, _ = outputs(engine(target, chunk=5, kv=kv), ps, max_tokens=10)
    got, result = outputs(engine(target, draft, k=3, chunk=5, kv=kv, drafter_kv=kv,
                                 sampled_drafts=False), ps, max_tokens=10)
    assert got == plain
    assert sum(c.stats.draft_tokens for c in result.completions) > 0

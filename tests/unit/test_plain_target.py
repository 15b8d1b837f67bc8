"""Targets without MTP modules (`cluster.plain_target`): checkpoints written by
`transformers`' own `save_pretrained` (Llama, Qwen2) are judged plain, with a reason that
names `chainspec train-mtp`; a stack config for them gets 0 drafters (local mode falls
back to remote with none) and a warning; a config that declares MTP modules whose
weights are missing is plain too; a model with MTP weights, or a directory that cannot
be read here, is left alone. Also the context rule: max_position_embeddings unless the
RoPE scaling extends it (vLLM's rule)."""

from __future__ import annotations

import json

import pytest

from chainspec.cli import main
from chainspec.cluster.config import DrafterRoleConfig, StackConfig
from chainspec.cluster.plain_target import (
    TRAIN_MTP,
    no_mtp_reason,
    refuse_drafters,
    serve_plainly,
)
from chainspec.engine.local import DEMO_MODEL, DrafterMode
from chainspec.models.config import ModelConfig
from tests.integration.tiny_checkpoint import write_hf_model, write_tiny_model
from tests.unit.checkpoints import hf_config

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return {arch: write_hf_model(tmp_path_factory.mktemp(arch), arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_target_is_plain_and_says_how_to_draft(hf_models, arch) -> None:
    reason = no_mtp_reason(hf_models[arch])
    assert reason is not None and "declares no MTP modules" in reason and arch in reason
    assert f"`{TRAIN_MTP}`" in reason
    with pytest.raises(ValueError, match="cannot add drafters.*chainspec train-mtp"):
        refuse_drafters(StackConfig(model_dir=str(hf_models[arch])))


@pytest.mark.parametrize("mode", ["remote", "local"])
def test_stack_config_gets_no_drafters_and_a_warning(hf_models, mode) -> None:
    config = StackConfig(model_dir=str(hf_models["LlamaForCausalLM"]),
                         drafter=DrafterRoleConfig(mode=mode))
    plain, warning = serve_plainly(config)
    assert (plain.drafter.mode, plain.drafter.replicas) == (DrafterMode.REMOTE, 0)
    assert TRAIN_MTP in warning and "plain decoding" in warning
    assert plain.verifier == config.verifier and plain.model_dir == config.model_dir
    assert serve_plainly(plain) == (plain, None)  # idempotent: asked for none, no warning


def test_declared_modules_without_weights_are_plain(tmp_path) -> None:
    model = write_tiny_model(tmp_path / "m", num_mtp=1)
    assert no_mtp_reason(model) is None  # weights present: it drafts
    (model / "mtp.safetensors").unlink()
    reason = no_mtp_reason(model)
    assert reason is not None and "declares 1 MTP module(s)" in reason \
        and "none of their weights" in reason and TRAIN_MTP in reason


def test_models_that_draft_or_cannot_be_read_are_left_alone(tmp_path) -> None:
    assert no_mtp_reason(DEMO_MODEL) is None
    config = StackConfig(drafter=DrafterRoleConfig(replicas=2))  # the demo model
    assert serve_plainly(config) == (config, None)
    refuse_drafters(config)
    # a path only the actors' nodes have: not judged here, its members report
    assert no_mtp_reason(tmp_path / "elsewhere") is None


def test_up_dry_run_shows_zero_drafters_and_warns(hf_models, capsys) -> None:
    model = hf_models["Qwen2ForCausalLM"]
    assert main(["up", "--dry-run", "--model", str(model), "--drafters", "2"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["config"]["drafter"]["replicas"] == 0
    assert "chainspec up: warning:" in out.err and TRAIN_MTP in out.err


@pytest.mark.parametrize(("scaling", "limit"), [
    (None, 512),
    ({"rope_type": "default"}, 512),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, 512),
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"type": "dynamic", "factor": 4.0}, 2048),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),
    ({"rope_type": "yarn", "factor": 2.0}, 1024),
])
def test_position_limit_follows_rope_scaling(scaling, limit) -> None:
    cfg = ModelConfig.from_hf(hf_config(max_position_embeddings=512, rope_scaling=scaling))
    assert cfg.position_limit == limit

"""The checkpoints people download load, and layout variants chainspec does not serve fail
with one line naming what is unsupported.

- Qwen3.5 release (`Qwen3_5ForConditionalGeneration`): the target's logits equal
  transformers' at every position; the vision tower is left unread with one warning line;
  the target and the drafter read the same weights as from the `Qwen3_5ForCausalLM`
  layout; speculative output with the release's `mtp.*` drafter equals plain.
- MiMo-V2-Flash's hub config spelling parses to the same config as transformers' spelling
  of the same model, and its checkpoint serves with transformers' logits.
- A table of unsupported variants per family: one CheckpointError line naming the field.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from transformers import MiMoV2FlashConfig

from chainspec.cluster.plain_target import no_mtp_reason
from chainspec.engine.kv_budget import KVBudget
from chainspec.models.attention import DenseCausal
from chainspec.models.config import ModelConfig
from chainspec.models.errors import CheckpointError
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.validate import check_model
from chainspec.training.train_mtp import MTPJob, train_mtp
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families import mimo_v2_flash_checkpoint as mimo
from tests.unit.families import moe_stack_checkpoint
from tests.unit.families import qwen3_5_checkpoint as qwen
from tests.unit.families.release_checkpoint import (
    mimo_hub_config,
    tensors_of,
    write_as_causal_lm,
    write_qwen3_5_release,
)

VOCAB = qwen.SHAPE["vocab_size"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_release")
    return path, write_qwen3_5_release(path, seed=3)


@torch.no_grad()
def dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    b, t = ids.shape
    hidden = model(ids.flatten(), torch.arange(t).repeat(b), DenseCausal(b, t))
    return model.logits(hidden).view(b, t, -1)


def random_ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def copy_of(path, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(path, out)
    return out


# --- Qwen3.5 releases -------------------------------------------------------------------

def test_release_logits_equal_transformers_at_every_position(release):
    path, hf = release
    ids = random_ids(3, 17)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = dense_logits(load_target(path), ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_vision_tower_left_unread_with_one_warning_line(release, caplog):
    path, _ = release
    vision = [n for n in tensors_of(path) if n.startswith("model.visual.")]
    assert vision
    with caplog.at_level(logging.WARNING, logger="chainspec.models.loader"):
        load_target(path)
    records = [r for r in caplog.records if r.name == "chainspec.models.loader"]
    assert len(records) == 1
    line = records[0].getMessage()
    assert "\n" not in line and "model.visual." in line and f"{len(vision)} tensors" in line
    assert records[0].exc_info is None


def test_release_reads_the_weights_of_the_causal_lm_layout(release, tmp_path):
    """Every target and drafter tensor comes from the release's own name for it."""
    path, _ = release
    flat = tmp_path / "flat"
    flat.mkdir()
    write_as_causal_lm(path, flat)
    for load in (load_target, load_draft_model):
        got, want = load(path).state_dict(), load(flat).state_dict()
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    draft, stored = load_draft_model(path), tensors_of(path)
    assert torch.equal(draft.embed_tokens.weight,
                       stored["model.language_model.embed_tokens.weight"])
    assert torch.equal(draft.mtp[0].eh_proj.weight, stored["mtp.fc.weight"])


def test_release_speculative_output_equals_plain(release):
    path, _ = release
    target, draft, kv = load_target(path), load_draft_model(path), KVBudget(block_size=4)
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (3, 9, 14)]
    plain = outputs(engine(target, chunk=5, kv=kv), prompts, max_tokens=10)[0]
    spec = engine(target, draft, k=3, chunk=5, kv=kv, drafter_kv=kv, sampled_drafts=False)
    assert outputs(spec, prompts, max_tokens=10)[0] == plain


def test_tied_release_shares_the_embedding(tmp_path):
    hf = write_qwen3_5_release(tmp_path, seed=4, tie=True)
    assert "lm_head.weight" not in tensors_of(tmp_path)  # transformers stores it once
    model = load_target(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = random_ids(2, 9)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    torch.testing.assert_close(dense_logits(model, ids), want, atol=1e-4, rtol=1e-4)
    draft = load_draft_model(tmp_path)
    assert draft.lm_head.weight is draft.embed_tokens.weight


def test_release_declares_its_mtp_layer_in_text_config(release, tmp_path):
    """`serve` drafts with it; a release that dropped `mtp.*` serves plainly, and says so
    (the count is read from `text_config`, where releases keep it)."""
    path, _ = release
    assert no_mtp_reason(path) is None
    check_model(path, drafts=True)
    dropped = copy_of(path, tmp_path)
    (dropped / "mtp.safetensors").unlink()
    assert "declares 1 MTP module(s) but its checkpoint holds none" in no_mtp_reason(dropped)


def test_release_that_dropped_mtp_gets_modules_in_its_layout(tmp_path):
    """train-mtp on a release without its `mtp.*` tensors: modules in the family's own
    names, next to the release's files, load back as its drafter."""
    from tests.integration.tiny_checkpoint import CORPUS, write_tokenizer
    from tests.unit.test_train_mtp import RECIPE, SETTINGS
    target, data, out = tmp_path / "target", tmp_path / "corpus", tmp_path / "out"
    write_qwen3_5_release(target, seed=5)
    (target / "mtp.safetensors").unlink()
    config = json.loads((target / "config.json").read_text())
    config["text_config"]["eos_token_id"] = write_tokenizer(target, VOCAB)
    (target / "config.json").write_text(json.dumps(config))
    data.mkdir()
    for i in range(12):
        (data / f"doc{i:02d}.txt").write_text(CORPUS[i % 3] * 3)
    train_mtp(MTPJob(target, str(data), out, replace(RECIPE, num_mtp=1),
                     replace(SETTINGS, checkpoint_every=0), False))
    assert set(tensors_of(out)) - set(tensors_of(target)) == set(qwen.mtp_shapes(
        qwen.hf_config()))
    draft = load_draft_model(out)
    assert draft.num_modules == 1
    assert torch.equal(draft.embed_tokens.weight,
                       tensors_of(target)["model.language_model.embed_tokens.weight"])


@pytest.mark.parametrize("edit", ["drop", "reshape"])
def test_release_bad_mtp_tensor_fails_with_one_line(release, tmp_path, edit):
    path, _ = release
    bad = copy_of(path, tmp_path)
    cfg = qwen.hf_config(mtp_num_hidden_layers=1)
    qwen.write_mtp(bad, cfg, **{edit: "mtp.layers.0.self_attn.k_proj.weight"})
    with pytest.raises(CheckpointError) as e:
        load_draft_model(bad)
    assert "\n" not in str(e.value) and "mtp.layers.0.self_attn.k_proj.weight" in str(e.value)


def test_release_extra_text_tensor_is_still_refused(release, tmp_path):
    """Only the vision tower is exempt from the no-leftovers rule."""
    path, _ = release
    bad = copy_of(path, tmp_path)
    save_file({"model.language_model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)},
              str(bad / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensors model\.language_model"):
        load_target(bad)


# --- MiMo-V2-Flash's hub config -----------------------------------------------------------

@pytest.fixture(scope="module")
def mimo_hub(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_hub")
    hf = mimo.write_checkpoint(path, seed=6)
    tf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(mimo_hub_config(tf)))
    return path, hf, tf


def test_mimo_hub_config_parses_as_transformers_layout(mimo_hub):
    _, _, tf = mimo_hub
    hub = mimo_hub_config(tf)
    assert "layer_types" not in hub and "sliding_window_size" in hub
    assert ModelConfig.from_hf(hub) == ModelConfig.from_hf(tf)
    # some hub configs also carry a flat rope_parameters (one theta): the per-kind
    # rope_theta / swa_rope_theta still decide
    flat = {"rope_theta": hub["rope_theta"], "rope_type": "default",
            "partial_rotary_factor": hub["partial_rotary_factor"]}
    assert ModelConfig.from_hf({**hub, "rope_parameters": flat}) == ModelConfig.from_hf(tf)


def test_mimo_hub_window_is_transformers_reading():
    """The hub's `sliding_window_size` W: a row sees W keys before it and itself; that is
    what transformers' own config makes of the field (W + 1)."""
    hub = mimo_hub_config(mimo_tf())
    assert hub["sliding_window_size"] == mimo.WINDOW - 1
    assert MiMoV2FlashConfig(sliding_window_size=mimo.WINDOW - 1).sliding_window == mimo.WINDOW
    assert ModelConfig.from_hf(hub).sliding_window == mimo.WINDOW


def test_mimo_hub_checkpoint_serves_with_transformers_logits(mimo_hub):
    path, hf, _ = mimo_hub
    ids = random_ids(2, 19)  # past the window of 8
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    torch.testing.assert_close(dense_logits(load_target(path), ids), want,
                               atol=1e-4, rtol=1e-4)
    assert len(load_draft_model(path).mtp) == mimo.NUM_MTP


def test_mimo_hub_sliding_kv_heads_and_sinks_are_read():
    """`swa_num_key_value_heads` need not be twice the full layers' (MiMo-V2.5 configs
    state equal counts); sinks follow the `add_*_attention_sink_bias` switches."""
    tf = {**mimo_tf(), "num_key_value_heads": 2}
    hub = {**mimo_hub_config(tf), "swa_num_key_value_heads": 2,
           "add_full_attention_sink_bias": True, "add_swa_attention_sink_bias": False}
    cfg = ModelConfig.from_hf(hub)
    full, sliding = cfg.shape("full_attention"), cfg.shape("sliding_attention")
    assert (full.num_kv_heads, sliding.num_kv_heads) == (2, 2)
    assert (full.sinks, sliding.sinks) == (True, False)


# --- unsupported variants: one line naming them --------------------------------------------

def qwen_text() -> dict:
    return {**json.loads(qwen.hf_config().to_json_string()),
            "architectures": ["Qwen3_5ForCausalLM"]}


def qwen_release() -> dict:
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": {**qwen_text(), "model_type": "qwen3_5_text"}}


def mimo_tf() -> dict:
    return {**json.loads(mimo.hf_config().to_json_string()),
            "architectures": ["MiMoV2FlashForCausalLM"]}


def deepseek() -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 2,
            "n_routed_experts": 4}


def moe_stack(family: str, arch: str) -> Callable[[], dict]:
    return lambda: {**json.loads(moe_stack_checkpoint.hf_config(family).to_json_string()),
                    "architectures": [arch]}


glm4 = moe_stack("glm4_moe", "Glm4MoeForCausalLM")
qwen3_moe = moe_stack("qwen3_moe", "Qwen3MoeForCausalLM")


def llama() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


def edit(base, **fields):
    return lambda: {**base(), **fields}


def edit_text(**fields):
    def make():
        cfg = qwen_release()
        cfg["text_config"].update(fields)
        return cfg
    return make


UNSUPPORTED = {
    "qwen3_5 MoE text model": (edit(qwen_text, num_experts=8), "num_experts 8"),
    "qwen3_5 unknown layer type": (
        edit(qwen_text, layer_types=["linear_attention", "mamba", "linear_attention",
                                     "full_attention"]), "mamba"),
    "qwen3_5 layer_types length": (edit(qwen_text, layer_types=["full_attention"]),
                                   "layer_types has 1 entries"),
    "qwen3_5 release MoE text_config": (edit_text(model_type="qwen3_5_moe_text"),
                                        "qwen3_5_moe_text"),
    "qwen3_5 release MoE fields": (edit_text(num_experts=4), "num_experts 4"),
    "qwen3_5 release without text_config": (edit(qwen_release, text_config=None),
                                            "text_config"),
    "qwen3_5_moe release with a dense text_config": (
        edit(qwen_release, architectures=["Qwen3_5MoeForConditionalGeneration"]),
        "text_config model_type 'qwen3_5_text' is not supported; qwen3_5_moe_text only"),
    "qwen3_5_moe without experts": (edit(qwen_text, architectures=["Qwen3_5MoeForCausalLM"]),
                                    "no num_experts"),
    "qwen3_next without a shared expert": (
        edit(qwen_text, architectures=["Qwen3NextForCausalLM"], num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=8,
             shared_expert_intermediate_size=0), "shared_expert_intermediate_size is 0"),
    "qwen3_next unsupported router": (
        edit(qwen_text, architectures=["Qwen3NextForCausalLM"], num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=8,
             shared_expert_intermediate_size=8, scoring_func="sigmoid"),
        "scoring_func='sigmoid'"),
    "qwen3_next layer pattern": (
        edit(qwen_text, architectures=["Qwen3NextForCausalLM"], num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=8,
             shared_expert_intermediate_size=8, decoder_sparse_step=0),
        "decoder_sparse_step=0"),
    "mimo_v2_flash MoE router (transformers)": (
        edit(mimo_tf, mlp_layer_types=["dense", "sparse", "dense", "dense"],
             scoring_func="softmax"), "scoring_func='softmax'"),
    "mimo_v2_flash unknown layer type": (
        edit(mimo_tf, layer_types=["full_attention", "chunked_attention",
                                   "sliding_attention", "full_attention"]),
        "chunked_attention"),
    "mimo_v2_flash MoE router (hub)": (
        lambda: {**mimo_hub_config(mimo_tf()), "moe_layer_freq": [0, 1, 1, 1],
                 "topk_method": "greedy"}, "topk_method='greedy'"),
    "mimo_v2_flash hub pattern value": (
        lambda: {**mimo_hub_config(mimo_tf()), "hybrid_layer_pattern": [0, 2, 1, 0]},
        "hybrid_layer_pattern values 2"),
    "mimo_v2_flash hub moe_layer_freq int": (
        lambda: {**mimo_hub_config(mimo_tf()), "moe_layer_freq": 1}, "moe_layer_freq 1"),
    "mimo_v2_flash fused qkv": (
        lambda: {**mimo_hub_config(mimo_tf()), "attention_projection_layout": "fused_qkv"},
        "fused_qkv"),
    "mimo_v2_flash swa head dim": (
        lambda: {**mimo_hub_config(mimo_tf()), "swa_head_dim": 8}, "swa_head_dim 8"),
    "deepseek_v3 MoE router": (edit(deepseek, first_k_dense_replace=1, num_experts_per_tok=2,
                                    moe_intermediate_size=16, topk_method="greedy"),
                               "topk_method='greedy'"),
    "glm4_moe_lite layer pattern": (edit(deepseek, architectures=["Glm4MoeLiteForCausalLM"],
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         mlp_layer_types=["dense"]), "mlp_layer_types"),
    "glm4_moe unsupported router": (edit(glm4, scoring_func="softmax"),
                                    "scoring_func='softmax'"),
    "glm4_moe layer pattern": (edit(glm4, moe_layer_freq=2), "moe_layer_freq=2"),
    "qwen3_moe unsupported router": (edit(qwen3_moe, scoring_func="sigmoid"),
                                     "scoring_func='sigmoid'"),
    "qwen3_moe sliding window": (edit(qwen3_moe, use_sliding_window=True),
                                 "use_sliding_window"),
    "llama unknown rope type": (edit(llama, rope_scaling={"rope_type": "longrope"}),
                                "longrope"),
    "mimo unknown rope type": (edit(llama, architectures=["MiMoForCausalLM"],
                                    rope_scaling={"rope_type": "longrope"}), "longrope"),
    "unknown architecture": (edit(llama, architectures=["FooForCausalLM"]), "FooForCausalLM"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_unsupported_variant_fails_with_one_line_naming_it(case, tmp_path):
    make, named = UNSUPPORTED[case]
    (tmp_path / "config.json").write_text(json.dumps(make()))
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_dir(tmp_path)
    assert "\n" not in str(e.value) and named in str(e.value)
    with pytest.raises(CheckpointError) as e:  # as serve checks it: before any tensor
        check_model(tmp_path, drafts=False)
    assert "\n" not in str(e.value) and named in str(e.value)
    assert "config.json" in str(e.value)


def test_the_unsupported_table_covers_every_family():
    from chainspec.models.families import registry
    covered = {case.split()[0] for case in UNSUPPORTED}
    assert {"qwen3_5", "mimo_v2_flash", "deepseek_v3", "llama"} <= covered
    missing = {f.name for f in registry().values()} - covered - {"step3"}  # its own tests
    assert not missing, f"add an UNSUPPORTED row for {sorted(missing)}"


def test_qwen3_5_mtp_with_its_own_embedding_fails_to_draft_with_one_line(release, tmp_path):
    path, _ = release
    bad = copy_of(path, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["text_config"]["mtp_use_dedicated_embeddings"] = True
    (bad / "config.json").write_text(json.dumps(config))
    load_target(bad)  # the target still serves
    with pytest.raises(CheckpointError) as e:
        load_draft_model(bad)
    assert "\n" not in str(e.value) and "mtp_use_dedicated_embeddings" in str(e.value)

"""Checkpoint loading: the file rule, strictness, clear errors, dtype, and a drafter that
reads only the embedding, the LM head and the MTP tensors."""

from __future__ import annotations

import json

import pytest
import torch

import chainspec.models.checkpoint as checkpoint_module
from chainspec.models.attention import DenseCausal
from chainspec.models.errors import CheckpointError
from chainspec.models.loader import load_draft_model, load_target
from tests.unit.checkpoints import (
    demo_checkpoint,
    hf_config,
    random_tensors,
    target_shapes,
    write_checkpoint,
    write_index,
)

MTP_NAMES = ("model.embed_tokens.weight", "lm_head.weight", "model.layers.2.",
             "model.layers.3.", "model.layers.4.")


def is_drafter_tensor(name: str) -> bool:
    return name.startswith(MTP_NAMES)


def target_logits(model, ids):
    backend = DenseCausal(1, len(ids), model.attention_scale)
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids)), backend))


# --- the layout rule ----------------------------------------------------------------------

def test_demo_layout_loads_target_and_drafter_with_every_tensor_in_place(tmp_path):
    _, target, mtp = demo_checkpoint(tmp_path)
    model = load_target(tmp_path)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight,
                       target["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.lm_head.weight, target["lm_head.weight"])
    draft = load_draft_model(tmp_path)
    assert draft.num_modules == 3
    assert torch.equal(draft.mtp[2].block.self_attn.k_proj.weight,
                       mtp["model.layers.4.self_attn.k_proj.weight"])
    assert torch.equal(draft.mtp[1].final_norm.weight,
                       mtp["model.layers.3.shared_head.norm.weight"])
    assert torch.equal(draft.embed_tokens.weight, target["model.embed_tokens.weight"])


def test_tied_head_is_one_parameter_with_the_embedding(tmp_path):
    demo_checkpoint(tmp_path, tied=True)
    model, draft = load_target(tmp_path), load_draft_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert draft.lm_head.weight is draft.embed_tokens.weight


def test_sharded_index_plus_unindexed_mtp_file(tmp_path):
    cfg = hf_config(num_nextn_predict_layers=1)
    _, target, mtp = demo_checkpoint(tmp_path / "flat", mtp=1)
    names = sorted(target)
    write_checkpoint(tmp_path, cfg, {"mtp.safetensors": mtp})
    write_index(tmp_path, {"model-1.safetensors": {k: target[k] for k in names[:9]},
                           "model-2.safetensors": {k: target[k] for k in names[9:]}})
    ids = torch.tensor([3, 1, 4, 1, 5])
    torch.testing.assert_close(target_logits(load_target(tmp_path), ids),
                               target_logits(load_target(tmp_path / "flat"), ids))
    assert load_draft_model(tmp_path).num_modules == 1


def test_consolidated_file_is_skipped(tmp_path):
    demo_checkpoint(tmp_path)
    write_checkpoint(tmp_path, None, {"consolidated.safetensors":
                                      {"layers.0.attention.wq.weight": torch.zeros(2, 2)}})
    load_target(tmp_path)


def test_tensor_in_two_files_names_both(tmp_path):
    _, target, _ = demo_checkpoint(tmp_path)
    write_checkpoint(tmp_path, None, {"extra.safetensors": {"model.norm.weight":
                                                            target["model.norm.weight"]}})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*(extra|model)\.safe"
                                              r"tensors.*(extra|model)\.safetensors"):
        load_target(tmp_path)


def test_index_naming_a_missing_shard(tmp_path):
    demo_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-9-of-9.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-9-of-9.safetensors"):
        load_target(tmp_path)


# --- bad checkpoints: one clear error each ---------------------------------------------

def test_missing_tensor_names_it_and_the_directory(tmp_path):
    cfg = hf_config()
    tensors = random_tensors(target_shapes(cfg))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    write_checkpoint(tmp_path, cfg, {"model.safetensors": tensors})
    with pytest.raises(CheckpointError) as err:
        load_target(tmp_path)
    assert "missing tensor model.layers.1.self_attn.v_proj.weight" in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_untied_checkpoint_without_lm_head_is_missing_it(tmp_path):
    cfg = hf_config()
    tensors = random_tensors(target_shapes(cfg))
    del tensors["lm_head.weight"]
    write_checkpoint(tmp_path, cfg, {"model.safetensors": tensors})
    with pytest.raises(CheckpointError, match="missing tensor lm_head.weight"):
        load_target(tmp_path)


def test_missing_mtp_tensor_for_the_drafter(tmp_path):
    cfg, target, mtp = demo_checkpoint(tmp_path)
    del mtp["model.layers.3.hnorm.weight"]
    write_checkpoint(tmp_path, cfg, {"mtp.safetensors": mtp})
    load_target(tmp_path)  # the target does not need it
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.3\.hnorm\.weight"):
        load_draft_model(tmp_path)


def test_wrong_shape_names_file_tensor_and_both_shapes(tmp_path):
    cfg = hf_config()
    tensors = random_tensors(target_shapes(cfg))
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    write_checkpoint(tmp_path, cfg, {"model.safetensors": tensors})
    with pytest.raises(CheckpointError) as err:
        load_target(tmp_path)
    message = str(err.value)
    assert "model.safetensors" in message and "model.layers.0.mlp.up_proj.weight" in message
    assert "[47, 32]" in message and "expected [48, 32]" in message


@pytest.mark.parametrize("load", [load_target, load_draft_model])
def test_unknown_architecture(tmp_path, load):
    cfg, _, _ = demo_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForLM"]}))
    with pytest.raises(CheckpointError, match=r"config\.json.*unknown architecture 'FooForLM'"):
        load(tmp_path)


def test_architecture_override(tmp_path):
    cfg, _, _ = demo_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForLM"]}))
    assert load_target(tmp_path, architecture="LlamaForCausalLM").config.num_layers == 2
    assert load_draft_model(tmp_path, architecture="LlamaForCausalLM").num_modules == 3


def test_corrupt_header_names_the_file(tmp_path):
    demo_checkpoint(tmp_path)
    (tmp_path / "mtp.safetensors").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CheckpointError, match=r"mtp\.safetensors: corrupt safetensors header"):
        load_target(tmp_path)


def test_missing_config(tmp_path):
    demo_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    for load in (load_target, load_draft_model):
        with pytest.raises(CheckpointError, match=r"config\.json not found"):
            load(tmp_path)


def test_missing_config_field_is_named(tmp_path):
    cfg, _, _ = demo_checkpoint(tmp_path)
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="missing required field 'intermediate_size'"):
        load_target(tmp_path)


def test_unexpected_target_tensor_names_it_and_its_file(tmp_path):
    cfg = hf_config()
    tensors = random_tensors(target_shapes(cfg))
    tensors["model.layers.0.self_attn.rogue.weight"] = torch.zeros(2)
    write_checkpoint(tmp_path, cfg, {"model.safetensors": tensors})
    with pytest.raises(CheckpointError, match=r"unexpected tensors model\.layers\.0\.self_attn"
                                              r"\.rogue\.weight \(in model\.safetensors\)"):
        load_target(tmp_path)


def test_mtp_layers_are_unexpected_without_an_mtp_config(tmp_path):
    cfg, _, _ = demo_checkpoint(tmp_path)
    del cfg["num_nextn_predict_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unexpected tensors model\.layers\.2\."):
        load_target(tmp_path)


def test_moe_tensor_in_an_mtp_block_is_unexpected_for_the_drafter(tmp_path):
    demo_checkpoint(tmp_path)
    write_checkpoint(tmp_path, None, {"moe.safetensors": {
        "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(2)}})
    load_target(tmp_path)  # the MTP family's namespace is not the target's business
    with pytest.raises(CheckpointError, match=r"unexpected tensors model\.layers\.3\.mlp\."
                                              r"experts\.0\.gate_proj\.weight"):
        load_draft_model(tmp_path)


def test_old_rotary_buffers_are_ignored(tmp_path):
    cfg = hf_config()
    tensors = random_tensors(target_shapes(cfg))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    write_checkpoint(tmp_path, cfg, {"model.safetensors": tensors})
    load_target(tmp_path)


@pytest.mark.parametrize("asked", [0, 4])
def test_module_count_outside_the_checkpoint(tmp_path, asked):
    demo_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"asked for {asked} MTP modules.* has 3"):
        load_draft_model(tmp_path, num_modules=asked)


def test_drafter_of_a_model_without_mtp(tmp_path):
    cfg = hf_config()
    write_checkpoint(tmp_path, cfg, {"model.safetensors": random_tensors(target_shapes(cfg))})
    with pytest.raises(CheckpointError, match="'LlamaForCausalLM' declares no MTP modules"):
        load_draft_model(tmp_path)


def test_unknown_family_override(tmp_path):
    demo_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="unknown MTP family 'medusa'"):
        load_draft_model(tmp_path, family="medusa")


# --- dtype, device and what the drafter reads ---------------------------------------------

def test_bf16_load_keeps_rope_in_fp32_and_tracks_fp32_logits(tmp_path):
    demo_checkpoint(tmp_path)
    full, half = load_target(tmp_path), load_target(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.rotaries[0].inv_freq.dtype == torch.float32
    assert {p.dtype for p in load_draft_model(tmp_path, dtype=torch.bfloat16).parameters()} == {
        torch.bfloat16}
    ids = torch.tensor([5, 9, 2, 7, 7, 1])
    ref, got = target_logits(full, ids), target_logits(half, ids).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    assert not torch.equal(got, ref)


def test_device_is_honoured(tmp_path):
    demo_checkpoint(tmp_path)
    draft = load_draft_model(tmp_path, device="meta")
    assert {p.device.type for p in draft.parameters()} == {"meta"}


class SpyOpen:
    """Wraps safetensors.safe_open, recording opened files and tensors read."""

    def __init__(self, real):
        self.real, self.opened, self.read = real, [], []

    def __call__(self, path, framework):
        self.opened.append(path.rsplit("/", 1)[-1])
        handle, spy = self.real(path, framework=framework), self

        class Handle:
            def __getattr__(self, name):
                return getattr(handle, name)

            def get_tensor(self, name):
                spy.read.append(name)
                return handle.get_tensor(name)
        return Handle()


def test_drafter_reads_only_embedding_head_and_mtp_tensors(tmp_path, monkeypatch):
    _, target, mtp = demo_checkpoint(tmp_path)
    spy = SpyOpen(checkpoint_module.safe_open)
    monkeypatch.setattr(checkpoint_module, "safe_open", spy)
    load_draft_model(tmp_path)
    assert spy.read and all(is_drafter_tensor(n) for n in spy.read)
    assert set(spy.read) == set(mtp) | {"model.embed_tokens.weight", "lm_head.weight"}
    spy.read.clear()
    load_target(tmp_path)
    assert set(spy.read) == set(target)


def test_drafter_never_opens_a_shard_of_target_layers(tmp_path):
    """A corrupt shard that holds only target layers: the target load names it, the
    drafter load never opens it."""
    cfg, target, mtp = demo_checkpoint(tmp_path / "flat")
    shared = {k: v for k, v in target.items() if is_drafter_tensor(k)}
    layers = {k: v for k, v in target.items() if not is_drafter_tensor(k)}
    write_checkpoint(tmp_path, cfg, {"mtp.safetensors": mtp})
    write_index(tmp_path, {"model-00001-of-00002.safetensors": shared,
                           "model-00002-of-00002.safetensors": layers})
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)
    draft = load_draft_model(tmp_path)
    assert torch.equal(draft.mtp[0].eh_proj.weight, mtp["model.layers.2.eh_proj.weight"])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: corrupt"):
        load_target(tmp_path)


# --- a DeepSeek-shaped MoE drafter: what it holds -------------------------------------------

def test_moe_drafter_holds_only_embedding_head_and_its_mtp_layer(tmp_path, monkeypatch):
    """DeepSeek layout with MoE target layers and an MoE MTP layer (experts per expert):
    the target's layers (their experts included) sit in a corrupt shard the drafter never
    opens; what it reads is the embedding, the head and model.layers.{N}.* less the
    per-layer copies of the shared tensors, and its resident parameters and buffers are
    exactly those tensors, element for element."""
    from safetensors.torch import load_file

    from tests.unit.families.deepseek_v3_checkpoint import MOE, write_with_mtp
    hf, mtp = write_with_mtp(tmp_path / "flat", **MOE)
    n = hf.config.num_hidden_layers
    flat = load_file(str(tmp_path / "flat" / "model.safetensors"))
    shared = {k: v for k, v in flat.items() if k in ("model.embed_tokens.weight",
                                                     "lm_head.weight")}
    layers = {k: v for k, v in flat.items() if k not in shared}
    assert any(".mlp.experts." in k for k in layers)  # target experts are at stake
    model_dir = tmp_path / "sharded"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((tmp_path / "flat" / "config.json").read_text())
    write_checkpoint(model_dir, None, {"mtp.safetensors": mtp})
    write_index(model_dir, {"model-00001-of-00002.safetensors": shared,
                            "model-00002-of-00002.safetensors": layers})
    (model_dir / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)
    spy = SpyOpen(checkpoint_module.safe_open)
    monkeypatch.setattr(checkpoint_module, "safe_open", spy)
    draft = load_draft_model(model_dir)

    copies = {f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"}
    want = (set(mtp) - copies) | set(shared)
    assert "model-00002-of-00002.safetensors" not in spy.opened
    assert set(spy.read) == want and len(spy.read) == len(want)  # each read once
    assert not any(name.startswith(tuple(f"model.layers.{i}." for i in range(n)))
                   for name in spy.read)
    resident = sum(t.numel() for t in draft.state_dict().values())
    assert resident == sum(mtp[k].numel() for k in set(mtp) - copies) + sum(
        t.numel() for t in shared.values())
    held = draft.state_dict()["mtp.0.block.mlp.experts.gate_up_proj"]  # its own experts
    assert held.shape[0] == MOE["n_routed_experts"]
    assert resident < sum(t.numel() for t in flat.values())  # the target's are not held

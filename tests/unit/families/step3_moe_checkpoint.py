"""Tiny random Step-3.5-Flash checkpoints with MoE layers: transformers' own
`Step3p7TextModel` with `moe_layers_enum` "1,2,3" (its `Step3p7SparseMoeBlock`: 8 experts,
top-2, a sigmoid router with correction bias, a routed scaling factor applied after the
experts, one shared expert of its own width; layer 2's routed experts clamped by
`swiglu_limits`, its shared expert by `swiglu_limits_shared`), saved in the hub's layout as
SGLang's and vLLM's `step3p5.py` and transformers' conversion mapping read it -- names
spelled out here independently of chainspec's `checkpoint_name`:

    model.layers.{i}.moe.gate.weight [E, H]      model.layers.{i}.moe.router_bias [E]
    model.layers.{i}.moe.{gate,up}_proj.weight [E, I, H]   .moe.down_proj.weight [E, H, I]
    model.layers.{i}.share_expert.{gate,up,down}_proj.weight

The three dense MTP layers are `step3_checkpoint.write_mtp`'s."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.unit.families.mimo_v2_flash_moe_checkpoint import quiet
from tests.unit.families.step3_checkpoint import (
    NUM_MTP,
    Step3p5CausalLM,
    _randomise,
    hf_config,
    write_mtp,
)

EXPERTS, TOP_K, WIDTH, SHARED = 8, 2, 16, 24
MOE = dict(moe_layers_enum="1,2,3", n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
           moe_intermediate_size=WIDTH, share_expert_dim=SHARED,
           moe_router_scaling_factor=2.5,
           swiglu_limits=[0.0, 0.0, 0.05, 0.0] + [0.0] * NUM_MTP)


def hub_state(model: Step3p5CausalLM) -> dict[str, torch.Tensor]:
    """transformers' state dict renamed to the hub's MoE layout."""
    state = {}
    for key, value in model.model.state_dict().items():
        key, value = f"model.{key}", value.contiguous()
        if ".mlp.experts.gate_up_proj" in key:
            gate, up = (half.contiguous() for half in value.chunk(2, dim=1))
            state[key.replace("mlp.experts.gate_up_proj", "moe.gate_proj.weight")] = gate
            state[key.replace("mlp.experts.gate_up_proj", "moe.up_proj.weight")] = up
            continue
        for tf, hub in ((".mlp.experts.down_proj", ".moe.down_proj.weight"),
                        (".mlp.gate.e_score_correction_bias", ".moe.router_bias"),
                        (".mlp.gate.weight", ".moe.gate.weight"),
                        (".mlp.shared_experts.", ".share_expert.")):
            key = key.replace(tf, hub)
        state[key] = value.contiguous()
    state["lm_head.weight"] = model.lm_head.weight.detach().contiguous()
    return state


def write_target(path: Path, seed: int = 0, quiet_by: float = 1.0, **extra
                 ) -> Step3p5CausalLM:
    """`quiet_by` < 1: a quiet target (tests/integration/flash_moe_models.py)."""
    torch.manual_seed(seed)
    cfg = hf_config(**{**MOE, **extra})
    model = Step3p5CausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _randomise(dict(model.named_parameters()), gen)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    quiet(model, quiet_by)
    path.mkdir(parents=True, exist_ok=True)
    save_file(hub_state(model), str(path / "model.safetensors"))
    cfg.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Step3p5ForCausalLM"]
    config["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config))
    return model


def write_checkpoint(path: Path, seed: int = 0, **extra) -> Step3p5CausalLM:
    model = write_target(path, seed, **extra)
    write_mtp(path, model.config, seed + 1)
    return model

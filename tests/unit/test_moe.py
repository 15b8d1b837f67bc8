"""The MoE MLP kind against transformers' own MoE blocks (tiny configs, weights copied):
routing decisions equal for every router variant, ties included; block outputs equal
within fp32 tolerance; layer patterns equal transformers' per-layer choice; unsupported
routers and patterns fail with one line naming them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    Glm4MoeConfig,
    MiMoV2FlashConfig,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashMoE
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeSparseMoeBlock,
)
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from chainspec.models.errors import CheckpointError
from chainspec.models.moe import (
    MoEConfig,
    RouterConfig,
    Scoring,
    SparseMoE,
    expert_parts,
    route,
    sparse_layers,
    stacked_name,
)

H, I, T = 32, 16, 24
_SHAPE = dict(hidden_size=H, moe_intermediate_size=I, intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def _sigmoid(cls, **kw):
    return cls(**_SHAPE, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
               routed_scaling_factor=2.5, n_shared_experts=1, **kw)


# name -> (transformers block class, its config, our scoring, norm default, shared name)
VARIANTS = {
    "qwen3_moe": (Qwen3MoeSparseMoeBlock, lambda: Qwen3MoeConfig(
        **_SHAPE, num_experts=8, num_experts_per_tok=2), Scoring.SOFTMAX, False, None),
    "qwen3_moe_norm": (Qwen3MoeSparseMoeBlock, lambda: Qwen3MoeConfig(
        **_SHAPE, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
        Scoring.SOFTMAX, False, None),
    "qwen3_next": (Qwen3NextSparseMoeBlock, lambda: Qwen3NextConfig(
        **_SHAPE, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=24),
        Scoring.SOFTMAX, True, "shared_expert"),
    "qwen3_5_moe": (Qwen3_5MoeSparseMoeBlock, lambda: Qwen3_5MoeTextConfig(
        **_SHAPE, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=24),
        Scoring.SOFTMAX, True, "shared_expert"),
    "deepseek_v3": (DeepseekV3MoE, lambda: _sigmoid(DeepseekV3Config), Scoring.SIGMOID,
                    True, "shared_experts"),
    "deepseek_v3_no_norm": (DeepseekV3MoE, lambda: _sigmoid(
        DeepseekV3Config, norm_topk_prob=False), Scoring.SIGMOID, True, "shared_experts"),
    "glm4_moe": (Glm4MoeMoE, lambda: _sigmoid(Glm4MoeConfig), Scoring.SIGMOID, True,
                 "shared_experts"),
    "mimo_v2_flash": (MiMoV2FlashMoE, lambda: MiMoV2FlashConfig(
        **_SHAPE, n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.5),
        Scoring.SIGMOID, True, None),
}


def _ours(name: str, hf_cfg) -> MoEConfig:
    """Our config from the transformers config's dict (MoEConfig.from_hf on it)."""
    _, _, scoring, norm_default, shared = VARIANTS[name]
    cfg = MoEConfig.from_hf(hf_cfg.to_dict(), scoring, norm_default)
    if name == "qwen3_5_moe":  # always renormalises (no config field)
        cfg = dataclasses.replace(cfg, router=dataclasses.replace(cfg.router,
                                                                  norm_topk_prob=True))
    assert cfg.shared_name == (shared or "shared_experts")
    assert bool(cfg.shared_intermediate_size) == (shared is not None)
    return cfg


def _pair(name: str, seed: int = 0) -> tuple[torch.nn.Module, SparseMoE]:
    cls, make_cfg, *_ = VARIANTS[name]
    hf_cfg = make_cfg()
    torch.manual_seed(seed)
    hf = cls(hf_cfg).float()
    with torch.no_grad():
        for t in [*hf.parameters(), *hf.buffers()]:
            t.copy_(torch.randn_like(t) * 0.3)
    ours = SparseMoE(_ours(name, hf_cfg))
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def _hidden(seed: int = 1, rows: int = T) -> torch.Tensor:
    return torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))


def _hf_route(hf, x):
    _, weights, ids = hf.gate(x)
    return ids, weights.float()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_routing_equals_transformers(name: str) -> None:
    hf, ours = _pair(name)
    x = _hidden()
    want_ids, want_w = _hf_route(hf, x)
    ids, w = ours.gate(x)
    assert torch.equal(ids, want_ids), name
    assert torch.equal(w, want_w), name
    assert len(set(ids.flatten().tolist())) > ours.cfg.router.top_k  # routes spread


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_block_output_equals_transformers(name: str) -> None:
    hf, ours = _pair(name)
    x = _hidden(2)
    with torch.no_grad():
        want = hf(x.unsqueeze(0)).squeeze(0) if "qwen" in name else hf(x)
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _tie_experts(gate: torch.nn.Module, tied: list[int], bias: bool) -> None:
    """Give `tied` experts identical router rows (and biases): bit-identical scores."""
    with torch.no_grad():
        gate.weight[tied] = gate.weight[tied[0]].clone()
        if bias:
            gate.e_score_correction_bias[tied] = gate.e_score_correction_bias[tied[0]].clone()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next", "deepseek_v3", "mimo_v2_flash"])
def test_ties_break_as_transformers_breaks_them(name: str) -> None:
    """Tied experts straddle the top-k boundary on many rows (a tie the choice must break),
    and the choice is transformers' (torch.topk's rule, not lowest index first)."""
    hf, ours = _pair(name, seed=3)
    router = ours.cfg.router
    # sigmoid with groups: tie experts of the same group and of two different groups
    tied = [1, 2, 5, 6] if router.n_group == 1 else [0, 1, 4, 5, 9]
    for gate in (hf.gate, ours.gate):
        _tie_experts(gate, tied, router.has_bias)
    x = _hidden(4, rows=64)
    ids, w = ours.gate(x)
    want_ids, want_w = _hf_route(hf, x)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    chosen = torch.isin(ids, torch.tensor(tied)).sum(-1)  # [T] tied experts chosen
    split = ((chosen > 0) & (chosen < len(tied))).sum().item()
    assert split > 0, "no row had to break a tie"


def test_all_tied_rows_choose_as_transformers() -> None:
    for name in ("qwen3_moe", "deepseek_v3"):
        hf, ours = _pair(name)
        for gate in (hf.gate, ours.gate):
            with torch.no_grad():
                gate.weight.zero_()
                if hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.zero_()
        x = _hidden(5, rows=4)
        assert torch.equal(ours.gate(x)[0], _hf_route(hf, x)[0]), name


def test_group_limit_excludes_groups() -> None:
    """With 4 groups and topk_group 1, every chosen expert lies in one group; the
    correction bias moves choices but the weights are the uncorrected scores."""
    cfg = RouterConfig(16, 3, Scoring.SIGMOID, True, n_group=4, topk_group=1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, H, generator=g), torch.randn(16, H, generator=g)
    ids, weights = route(x, w, torch.zeros(16), cfg)
    assert ((ids // 4) == (ids[:, :1] // 4)).all()
    bias = torch.zeros(16)
    bias[12:] = 10.0  # group 3 always wins
    ids, weights = route(x, w, bias, cfg)
    assert (ids >= 12).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(40))  # renormalised, bias-free
    scores = torch.sigmoid(x @ w.T).gather(1, ids)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True))


def test_layer_patterns_equal_transformers() -> None:
    cfg = Qwen3MoeConfig(**{**_SHAPE, "num_hidden_layers": 6}, num_experts=4,
                         num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
    want = tuple(isinstance(Qwen3MoeDecoderLayer(cfg, i).mlp, Qwen3MoeSparseMoeBlock)
                 for i in range(6))
    assert want == (False, True, False, False, False, True)
    assert sparse_layers(cfg.to_dict(), 6) == want
    assert sparse_layers({"n_routed_experts": 4, "first_k_dense_replace": 2}, 4) == (
        False, False, True, True)
    types = ["dense", "sparse", "dense", "sparse"]
    assert sparse_layers({"n_routed_experts": 4, "mlp_layer_types": types}, 4) == (
        False, True, False, True)
    assert sparse_layers({"intermediate_size": 8}, 3) == (False,) * 3  # no experts


@pytest.mark.parametrize("cfg, words", [
    ({"n_routed_experts": 4, "mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types"),
    ({"n_routed_experts": 4, "mlp_layer_types": ["dense"]}, "mlp_layer_types"),
    ({"n_routed_experts": 4, "first_k_dense_replace": 1, "moe_layer_freq": 2},
     "moe_layer_freq=2"),
    ({"num_experts": 4, "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
])
def test_unsupported_layer_pattern_fails_naming_it(cfg: dict, words: str) -> None:
    with pytest.raises(CheckpointError, match=words) as e:
        sparse_layers(cfg, 2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("cfg, scoring, words", [
    ({"n_routed_experts": 8, "num_experts_per_tok": 2, "scoring_func": "softmax"},
     Scoring.SIGMOID, "scoring_func='softmax'"),
    ({"n_routed_experts": 8, "num_experts_per_tok": 2, "topk_method": "group_limited_greedy"},
     Scoring.SIGMOID, "topk_method='group_limited_greedy'"),
    ({"n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 3}, Scoring.SIGMOID,
     "n_group=3"),
    ({"n_routed_experts": 8, "num_experts_per_tok": 6, "n_group": 4, "topk_group": 1},
     Scoring.SIGMOID, "topk_group=1"),
    ({"num_experts": 4, "num_experts_per_tok": 5}, Scoring.SOFTMAX, "num_experts_per_tok=5"),
])
def test_unsupported_router_fails_naming_it(cfg: dict, scoring: Scoring, words: str) -> None:
    with pytest.raises(CheckpointError, match=words) as e:
        RouterConfig.from_hf(cfg, scoring, True)
    assert "\n" not in str(e.value)


def test_expert_layout_names() -> None:
    name = "model.layers.3.mlp.experts.gate_up_proj"
    parts = expert_parts(name, (2, 8, 4), {"model.layers.3.mlp.experts.0.gate_proj.weight"})
    assert parts is not None and parts.names == [
        "model.layers.3.mlp.experts.0.gate_proj.weight",
        "model.layers.3.mlp.experts.0.up_proj.weight",
        "model.layers.3.mlp.experts.1.gate_proj.weight",
        "model.layers.3.mlp.experts.1.up_proj.weight"]
    assert expert_parts(name, (2, 8, 4), {name}) is None  # fused layout: read as is
    assert expert_parts("model.layers.3.mlp.gate.weight", (2, 4), set()) is None
    with pytest.raises(CheckpointError, match=r"experts\.2\.gate_proj.weight: more experts"):
        expert_parts(name, (2, 8, 4), {"model.layers.3.mlp.experts.2.gate_proj.weight"})
    prefix = "m.layers.0.mlp.experts"
    assert stacked_name(f"{prefix}.7.up_proj.weight") == f"{prefix}.gate_up_proj"
    assert stacked_name(f"{prefix}.7.down_proj.weight") == f"{prefix}.down_proj"
    assert stacked_name("m.layers.0.mlp.shared_experts.down_proj.weight") is None


def test_stacking_puts_gate_rows_before_up_rows() -> None:
    parts = expert_parts("e.experts.gate_up_proj", (2, 4, 3), set())
    stored = {n: torch.full((2, 3), float(i)) for i, n in enumerate(parts.names)}
    stacked = parts.read(lambda n, shape: stored[n].expand(shape))
    assert stacked.shape == (2, 4, 3)
    assert stacked[:, :, 0].tolist() == [[0, 0, 1, 1], [2, 2, 3, 3]]


# ---------------------------------------------------------------------------------------
# Loading: per-expert and fused checkpoint layouts (models/loader.py reads through these).


class _Holder(torch.nn.Module):
    """A layer's `mlp` as the loader sees it in a model's state dict."""

    def __init__(self, block: SparseMoE) -> None:
        super().__init__()
        self.mlp = block


def _save(tmp_path, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save_file
    save_file({k: v.clone() for k, v in tensors.items()}, tmp_path / "model.safetensors")


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers' save_pretrained writes: experts split per expert."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    gate_up, down = state["mlp.experts.gate_up_proj"], state["mlp.experts.down_proj"]
    for e in range(gate_up.shape[0]):
        g, u = gate_up[e].chunk(2)
        out |= {f"mlp.experts.{e}.gate_proj.weight": g, f"mlp.experts.{e}.up_proj.weight": u,
                f"mlp.experts.{e}.down_proj.weight": down[e]}
    return out


def _load(tmp_path, dtype=torch.float32):
    from chainspec.models import loader
    from chainspec.models.checkpoint import CheckpointFiles
    _, ours = _pair("deepseek_v3")
    model = _Holder(SparseMoE(ours.cfg))
    names = {k: k for k in model.state_dict()}
    with CheckpointFiles(tmp_path) as files:
        loader._check_unexpected(files, set(names))
        return loader._read_all(files, names, model, dtype, "cpu")


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_both_layouts_load_the_same_stacked_tensors(tmp_path, layout: str) -> None:
    hf, _ = _pair("deepseek_v3")
    state = {f"mlp.{k}": v for k, v in hf.state_dict().items()}
    _save(tmp_path, _per_expert(state) if layout == "per_expert" else state)
    got = _load(tmp_path)
    assert set(got) == set(state)
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_bf16_load_keeps_the_correction_bias_fp32(tmp_path) -> None:
    hf, _ = _pair("deepseek_v3")
    _save(tmp_path, _per_expert({f"mlp.{k}": v for k, v in hf.state_dict().items()}))
    got = _load(tmp_path, torch.bfloat16)
    assert got["mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert got["mlp.experts.gate_up_proj"].dtype == torch.bfloat16


@pytest.mark.parametrize("damage, words", [
    ("drop", r"missing tensor mlp\.experts\.3\.up_proj\.weight"),
    ("reshape", r"tensor mlp\.experts\.3\.up_proj\.weight has shape \[8, 32\]"),
    ("extra", r"tensor mlp\.experts\.16\.gate_proj\.weight: more experts than the config's 16"),
    ("stray", r"unexpected tensors mlp\.experts\.3\.w9\.weight"),
])
def test_per_expert_errors_name_the_tensor(tmp_path, damage: str, words: str) -> None:
    hf, _ = _pair("deepseek_v3")
    tensors = _per_expert({f"mlp.{k}": v for k, v in hf.state_dict().items()})
    name = "mlp.experts.3.up_proj.weight"
    if damage == "drop":
        del tensors[name]
    elif damage == "reshape":
        tensors[name] = tensors[name][:8]
    elif damage == "extra":
        tensors["mlp.experts.16.gate_proj.weight"] = tensors[name]
    else:
        tensors["mlp.experts.3.w9.weight"] = tensors[name]
    _save(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=words) as e:
        _load(tmp_path)
    assert "\n" not in str(e.value)

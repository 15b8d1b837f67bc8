"""Qwen3-Next's and Qwen3.5-MoE's MTP drafters against a reference of their equations
written from the checkpoint tensors (vLLM's `qwen3_next_mtp.py` / `qwen3_5_mtp.py` layout),
with transformers' own decoder layer (gated full attention + its sparse MoE block) as the
block:

    u       = mtp.fc(concat(zc_norm(Emb(x[p+k]), pre_fc_norm_embedding),
                            zc_norm(g[k-1][p], pre_fc_norm_hidden)))
    b[k][p] = mtp.layers.0(u)              # causal over the rows; MoE MLP
    g[k][p] = zc_norm(b[k][p], mtp.norm);  logits = LMHead(g[k][p])
with g[0] = h (after the target's final norm), zc_norm(x, w) = rmsnorm(x) * (1 + w), one
layer reused for every step, chained through mtp.norm (what vLLM's module returns). Also:
the drafter reads only the embedding, head and `mtp.*` (no target expert), and a missing
or mis-shaped MTP tensor fails with one line naming it."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeTextRotaryEmbedding,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextRotaryEmbedding,
)

from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.errors import CheckpointError
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_draft_model
from chainspec.models.moe import SparseMoE
from tests.unit.families.qwen3_next_checkpoint import (
    fused_mtp_block,
    hf_config,
    write_checkpoint,
    write_mtp,
)

ROWS, STEPS = 11, 3
BLOCK = 4
HF_BLOCKS = {"qwen3_next": (Qwen3NextDecoderLayer, Qwen3NextRotaryEmbedding),
             "qwen3_5_moe": (Qwen3_5MoeDecoderLayer, Qwen3_5MoeTextRotaryEmbedding)}


@pytest.fixture(scope="module", params=list(HF_BLOCKS))
def checkpoint(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(f"{family}_mtp")
    hf = write_checkpoint(family, path, seed=2)
    with safe_open(str(path / "mtp.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors["embed"] = hf.model.embed_tokens.weight.detach()
    tensors["head"] = hf.lm_head.weight.detach()
    return family, tensors, load_draft_model(path)


def zc_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


@torch.no_grad()
def reference(family: str, tensors, tokens: torch.Tensor, hidden: torch.Tensor
              ) -> list[torch.Tensor]:
    """tokens x[0..ROWS+STEPS-1], hidden h[0..ROWS-1] -> logits [ROWS, V] per step."""
    layer_cls, rotary_cls = HF_BLOCKS[family]
    cfg = hf_config(family, num_hidden_layers=1, layer_types=["full_attention"],
                    **({"mlp_only_layers": []} if family == "qwen3_next" else {}))
    block = layer_cls(cfg, 0).eval()
    block.load_state_dict(fused_mtp_block(tensors), strict=True)
    rotary = rotary_cls(cfg)
    positions = torch.arange(ROWS)[None]
    causal = torch.full((ROWS, ROWS), float("-inf")).triu(1)[None, None]
    prev, out = hidden, []
    for k in range(1, STEPS + 1):
        emb = tensors["embed"][tokens[k:k + ROWS]]
        u = torch.cat([zc_norm(emb, tensors["mtp.pre_fc_norm_embedding.weight"]),
                       zc_norm(prev, tensors["mtp.pre_fc_norm_hidden.weight"])], -1)
        x = (u @ tensors["mtp.fc.weight"].T)[None]
        b = block(x, position_embeddings=rotary(x, positions), attention_mask=causal)[0]
        prev = zc_norm(b, tensors["mtp.norm.weight"])  # chained through mtp.norm
        out.append(prev @ tensors["head"].T)
    return out


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (ROWS + STEPS,), generator=gen),
            torch.randn(ROWS, 32, generator=gen))


@torch.no_grad()
def drafter_dense(model, tokens, hidden) -> list[torch.Tensor]:
    prev, out = hidden, []
    for k in range(1, STEPS + 1):
        g = model.step(k, tokens[k:k + ROWS], prev, torch.arange(ROWS), DenseCausal(1, ROWS))
        out.append(model.logits(k, g))
        prev = model.next_input(k, g, hidden)
    return out


@torch.no_grad()
def drafter_paged(model, tokens, hidden) -> list[torch.Tensor]:
    """The same rows in two chunks (7 + 4) through a paged cache, one KV layer per step."""
    cache = ModelKVCache(model.cache_specs(STEPS), {None: 6}, BLOCK)
    table = [3, 0, 5]
    out = [[] for _ in range(STEPS)]
    for lo, hi in [(0, 7), (7, ROWS)]:
        batch = AttnBatch.build([SeqRows(table, lo, hi - lo)], BLOCK)
        prev = hidden[lo:hi]
        for k in range(1, STEPS + 1):
            g = model.step(k, tokens[lo + k:hi + k], prev, batch.positions,
                           PagedAttention(cache, batch))
            out[k - 1].append(model.logits(k, g))
            prev = model.next_input(k, g, hidden)
    return [torch.cat(parts) for parts in out]


def test_drafter_loads_one_moe_module_and_no_target_expert(checkpoint):
    family, tensors, model = checkpoint
    assert model.num_modules == 1
    block = model.mtp[0].block
    assert block.self_attn.output_gate and block.input_layernorm.unit_offset
    assert isinstance(block.mlp, SparseMoE) and block.mlp.cfg.shared_gate
    assert not any(n.startswith("model.layers") for n in model.state_dict())
    params = sum(p.numel() for p in model.parameters())
    mtp = sum(t.numel() for n, t in tensors.items() if n.startswith("mtp."))
    assert params == mtp + tensors["embed"].numel() + tensors["head"].numel()


@pytest.mark.parametrize("run", [drafter_dense, drafter_paged], ids=["dense", "paged"])
def test_drafter_matches_the_reference(checkpoint, run):
    family, tensors, model = checkpoint
    tokens, hidden = inputs()
    want = reference(family, tensors, tokens, hidden)
    for k, (got, ref) in enumerate(zip(run(model, tokens, hidden), want, strict=True), 1):
        assert ref.abs().max() > 0.5
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"step {k}")


@pytest.mark.parametrize("family,broken,expected", [
    ("qwen3_next", dict(drop="mtp.layers.0.mlp.experts.3.up_proj.weight"),
     "missing tensor mtp.layers.0.mlp.experts.3.up_proj.weight"),
    ("qwen3_next", dict(drop="mtp.layers.0.mlp.shared_expert_gate.weight"),
     "missing tensor mtp.layers.0.mlp.shared_expert_gate.weight"),
    ("qwen3_next", dict(reshape="mtp.layers.0.mlp.gate.weight"),
     "tensor mtp.layers.0.mlp.gate.weight has shape [5, 32], expected [4, 32]"),
    ("qwen3_next", dict(reshape="mtp.fc.weight"),
     "tensor mtp.fc.weight has shape [33, 64], expected [32, 64]"),
    ("qwen3_5_moe", dict(reshape="mtp.layers.0.mlp.experts.gate_up_proj"),
     "tensor mtp.layers.0.mlp.experts.gate_up_proj has shape [5, 32, 32], expected "
     "[4, 32, 32]"),
    ("qwen3_5_moe", dict(drop="mtp.layers.0.mlp.experts.down_proj"),  # neither layout
     "missing tensor mtp.layers.0.mlp.experts.0.down_proj.weight"),
])
def test_a_missing_or_misshaped_mtp_tensor_fails_naming_it(tmp_path, family, broken,
                                                           expected):
    hf = write_checkpoint(family, tmp_path, seed=3)
    write_mtp(family, tmp_path, hf.config, **broken)  # overwrites mtp.safetensors
    with pytest.raises(CheckpointError) as err:
        load_draft_model(tmp_path)
    assert expected in str(err.value) and "\n" not in str(err.value)

"""Qwen3.5's MTP drafter against a reference of its equations written from the checkpoint
tensors (vLLM's `qwen3_5_mtp.py` layout), with transformers' own `Qwen3_5DecoderLayer`
as the block:

    u       = mtp.fc(concat(zc_norm(Emb(x[p+k]), pre_fc_norm_embedding),
                            zc_norm(g[k-1][p], pre_fc_norm_hidden)))
    g[k][p] = mtp.layers.0(u)              # gated full attention, causal over the rows
    logits  = LMHead(zc_norm(g[k][p], mtp.norm))
with g[0] = h (after the target's final norm), zc_norm(x, w) = rmsnorm(x) * (1 + w), one
layer reused for every step and chained. Also: a missing or mis-shaped MTP tensor fails
with one line naming it."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5TextRotaryEmbedding,
)

from chainspec.models.attention import AttnBatch, DenseCausal, PagedAttention, SeqRows
from chainspec.models.errors import CheckpointError
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_draft_model
from tests.unit.families.qwen3_5_checkpoint import hf_config, write_checkpoint, write_mtp

ROWS, STEPS = 11, 3
BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_mtp")
    hf = write_checkpoint(path, seed=2)
    with safe_open(str(path / "mtp.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors["embed"] = hf.model.embed_tokens.weight.detach()
    tensors["head"] = hf.lm_head.weight.detach()
    return hf.config, tensors, load_draft_model(path)


def zc_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def hf_block(cfg, tensors) -> Qwen3_5DecoderLayer:
    block_cfg = hf_config(num_hidden_layers=1, layer_types=["full_attention"])
    block = Qwen3_5DecoderLayer(block_cfg, 0).eval()
    block.load_state_dict({n.removeprefix("mtp.layers.0."): t for n, t in tensors.items()
                           if n.startswith("mtp.layers.0.")}, strict=True)
    return block


@torch.no_grad()
def reference(cfg, tensors, tokens: torch.Tensor, hidden: torch.Tensor
              ) -> list[torch.Tensor]:
    """tokens x[0..ROWS+STEPS-1], hidden h[0..ROWS-1] -> logits [ROWS, V] per step."""
    block, rotary = hf_block(cfg, tensors), Qwen3_5TextRotaryEmbedding(hf_config())
    positions = torch.arange(ROWS)[None]
    causal = torch.full((ROWS, ROWS), float("-inf")).triu(1)[None, None]
    prev, out = hidden, []
    for k in range(1, STEPS + 1):
        emb = tensors["embed"][tokens[k:k + ROWS]]
        u = torch.cat([zc_norm(emb, tensors["mtp.pre_fc_norm_embedding.weight"]),
                       zc_norm(prev, tensors["mtp.pre_fc_norm_hidden.weight"])], -1)
        x = (u @ tensors["mtp.fc.weight"].T)[None]
        g = block(x, position_embeddings=rotary(x, positions), attention_mask=causal)[0]
        out.append(zc_norm(g, tensors["mtp.norm.weight"]) @ tensors["head"].T)
        prev = zc_norm(g, tensors["mtp.norm.weight"])  # chained through mtp.norm (vLLM, SGLang)
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
            prev = model.next_input(k, g, hidden[lo:hi])
    return [torch.cat(parts) for parts in out]


def test_drafter_loads_one_module_of_the_family_block(checkpoint):
    _, _, model = checkpoint
    assert model.num_modules == 1
    block = model.mtp[0].block
    assert block.self_attn.output_gate and block.input_layernorm.unit_offset


@pytest.mark.parametrize("run", [drafter_dense, drafter_paged], ids=["dense", "paged"])
def test_drafter_matches_the_reference(checkpoint, run):
    cfg, tensors, model = checkpoint
    tokens, hidden = inputs()
    want = reference(cfg, tensors, tokens, hidden)
    for k, (got, ref) in enumerate(zip(run(model, tokens, hidden), want, strict=True), 1):
        assert ref.abs().max() > 0.5
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"step {k}")


@pytest.mark.parametrize("broken,expected", [
    (dict(drop="mtp.layers.0.self_attn.q_norm.weight"),
     "missing tensor mtp.layers.0.self_attn.q_norm.weight"),
    (dict(drop="mtp.pre_fc_norm_hidden.weight"), "missing tensor mtp.pre_fc_norm_hidden"),
    (dict(reshape="mtp.fc.weight"), "tensor mtp.fc.weight has shape [33, 64], expected "
                                    "[32, 64]"),
    (dict(reshape="mtp.layers.0.self_attn.q_proj.weight"),
     "mtp.layers.0.self_attn.q_proj.weight has shape [129, 32], expected [128, 32]"),
])
def test_a_missing_or_misshaped_mtp_tensor_fails_naming_it(tmp_path, broken, expected):
    hf = write_checkpoint(tmp_path, seed=3)
    write_mtp(tmp_path, hf.config, **broken)  # overwrites mtp.safetensors
    with pytest.raises(CheckpointError) as err:
        load_draft_model(tmp_path)
    assert expected in str(err.value) and "\n" not in str(err.value)

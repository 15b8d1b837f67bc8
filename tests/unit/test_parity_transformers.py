"""Target parity with transformers: checkpoints written by `save_pretrained` load through
`load_target` and give the same logits (fp32, atol 1e-4) as transformers' own forward,
with rows of several sequences packed into one step: whole prefills, prefill chunks,
verify-sized windows and single decode rows against the slot KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from chainspec.models.attention import AttnBatch, PagedAttention, SeqRows
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_target

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
CASES = {
    "llama_gqa": (LlamaForCausalLM, LlamaConfig, {}),
    "llama_mha_tied_linear": (LlamaForCausalLM, LlamaConfig, dict(
        num_key_value_heads=4, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_llama3": (LlamaForCausalLM, LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama_yarn": (LlamaForCausalLM, LlamaConfig, dict(rope_theta=500.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_dynamic": (LlamaForCausalLM, LlamaConfig, dict(
        rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "qwen2_tied": (Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3_head_dim": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=None)),
}
LENGTHS = {"a": 9, "b": 11, "c": 5}
BLOCK = 4
# Interleaved, out-of-order blocks, so block-table mix-ups show.
TABLES = {"a": [5, 0, 7], "b": [1, 8, 3], "c": [6, 2]}
# Each step packs rows [lo, hi) of several sequences into one forward.
SCHEDULE = [
    {"a": (0, 7), "b": (0, 4), "c": (0, 1)},  # a prefill, b first chunk, c one row
    {"a": (7, 8), "b": (4, 11), "c": (1, 3)},  # a decode, b last chunk, c 2-row chunk
    {"a": (8, 9), "c": (3, 5)},  # a decode, c verify-sized window
]


def write_hf_model(path, name: str, shard: str | None = None) -> torch.nn.Module:
    model_cls, config_cls, extra = CASES[name]
    torch.manual_seed(len(name))
    model = model_cls(config_cls(**{**SHAPE, **extra})).eval()
    with torch.no_grad():  # every tensor random, norms and biases included
        for pname, p in model.named_parameters():
            p.normal_(1.0 if "norm" in pname else 0.0, 0.2 if p.dim() == 1 else 0.5 / 32 ** 0.5)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


def hf_logits(model, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {s: model(input_ids=t[None]).logits[0] for s, t in ids.items()}


def packed_logits(model, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run SCHEDULE through chainspec; logits of every row, gathered per sequence."""
    cfg = model.config
    cache = ModelKVCache.uniform(cfg.num_layers, 9, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    rows: dict[str, list[torch.Tensor]] = {s: [] for s in ids}
    for step in SCHEDULE:
        batch = AttnBatch.build([SeqRows(TABLES[s], lo, hi - lo) for s, (lo, hi) in step.items()],
                                BLOCK)
        tokens = torch.cat([ids[s][lo:hi] for s, (lo, hi) in step.items()])
        with torch.no_grad():
            hidden = model(tokens, batch.positions,
                           PagedAttention(cache, batch, model.attention_scale))
            logits = model.logits(hidden)
        for s, part in zip(step, logits.split([hi - lo for lo, hi in step.values()]),
                           strict=True):
            rows[s].append(part)
    return {s: torch.cat(parts) for s, parts in rows.items()}


def random_ids(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {s: torch.randint(0, vocab, (n,), generator=gen) for s, n in LENGTHS.items()}


def assert_parity(hf_model, path) -> None:
    model = load_target(path)
    ids = random_ids(SHAPE["vocab_size"])
    want, got = hf_logits(hf_model, ids), packed_logits(model, ids)
    for s in ids:
        assert want[s].abs().max() > 1.0  # logits large enough that a mismatch shows
        torch.testing.assert_close(got[s], want[s], atol=1e-4, rtol=1e-5, msg=f"sequence {s}")


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    assert_parity(write_hf_model(tmp_path, name), tmp_path)


def test_sharded_checkpoint_matches(tmp_path):
    hf_model = write_hf_model(tmp_path, "llama_gqa", shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert_parity(hf_model, tmp_path)


def test_tied_checkpoint_has_no_head_and_loads_tied(tmp_path):
    write_hf_model(tmp_path, "qwen2_tied")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = load_target(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight

"""Tensor-parallel baseline on one device (issue 22): the TP=1 verify step of
`benchmarks/tp_step.py` -- layers shaped like an 8B Llama (hidden 4096, 32 heads over 8
KV heads, head dim 128, MLP 14336, vocab 32000), random weights -- on the GPU, through
the engine's paged path plus the LM head, for 2 and 4 layers and 4..64 verify rows
(K + 1 = 4 per sequence). These are the figures a multi-GPU TP run is compared with;
TP > 1 on NCCL needs a second device and is recorded as not measured until one is lent.
`per_layer_ms` is (step - LM head) / layers, the embedding included."""

from __future__ import annotations

import torch

from benchmarks.gpu.timing import Budget, Context, each_size, median_ms
from benchmarks.tp_step import BLOCK, ROWS_PER_SEQ, llama8b, step_inputs
from chainspec.models.attention import PagedAttention
from chainspec.models.config import ModelConfig
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.target import TargetModel
from chainspec.models.tensor_parallel import empty_weights

CONTEXT = 1024
SIZES = ((2, 1), (2, 4), (2, 16), (4, 1), (4, 4), (4, 16))  # (layers, sequences)
TINY_SIZES = ((2, 1), (2, 2))
TINY_CONTEXT = 40


def tiny(layers: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position=512)


def device_model(cfg: ModelConfig, ctx: Context) -> TargetModel:
    """Random weights made on the device in the run's dtype (no host copy of 2 GB)."""
    with empty_weights():
        model = TargetModel(cfg)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    state = {k: torch.randn(v.shape, generator=gen, device=ctx.device, dtype=ctx.dtype)
             .mul_(0.02) for k, v in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(ctx.device).eval()  # the real (non-persistent) buffers too


def measure_step(cfg: ModelConfig, seqs: int, context: int, ctx: Context) -> dict:
    model = device_model(cfg, ctx)
    ids, batch, blocks = step_inputs(seqs, context, ctx.device, cfg.vocab_size)
    cache = ModelKVCache(model.cache_specs(), {None: blocks}, BLOCK, dtype=ctx.dtype,
                         device=ctx.device)
    hidden = model(ids, batch.positions, PagedAttention(cache, batch, model.attention_scale))

    def step() -> None:
        h = model(ids, batch.positions, PagedAttention(cache, batch, model.attention_scale))
        model.logits(h)

    step_ms = median_ms(step, ctx)
    head_ms = median_ms(lambda: model.logits(hidden), ctx)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"tp": 1, "layers": cfg.num_layers, "rows": ids.numel(), "context": context,
            "step_ms": step_ms, "lm_head_ms": head_ms,
            "per_layer_ms": (step_ms - head_ms) / cfg.num_layers,
            "all_reduces_per_step": 0, "param_MB": params / 2**20}


def tp_step_section(ctx: Context, budget: Budget) -> dict:
    sizes, context = (TINY_SIZES, TINY_CONTEXT) if ctx.dry_run else (SIZES, CONTEXT)
    shape = tiny if ctx.dry_run else llama8b

    def measure(size) -> dict:
        layers, seqs = size
        return measure_step(shape(layers), seqs, context, ctx)

    with torch.inference_mode():
        out = each_size(sizes, budget, measure)
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    out.update(shape="tiny llama (dry run)" if ctx.dry_run else "llama8b layers, vocab 32000",
               rows_per_seq=ROWS_PER_SEQ, dtype=str(ctx.dtype),
               tp2=f"not measured: needs 2 GPUs, {gpus} visible")
    return out

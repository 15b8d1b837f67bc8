"""Fused MoE: the Triton kernel against its torch reference on one MoE layer shaped like
DeepSeek-V3's (random weights): 256 experts of width 2048 over hidden 7168, top-8 of 8
groups (4 kept), at decode/verify-sized and prefill-sized row counts.

Routing comes from the layer's own router (`models/moe.py`) on random hidden states, so
the experts hit are what a real step would see: a decode row touches 8 experts, a 512-row
prefill chunk nearly all 256. Decode is bound by the expert weights read: `weights_GB` is
the bytes of the experts hit, `kernel_TBps` that over the kernel's time."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from benchmarks.gpu.timing import Budget, Context, each_size, median_ms
from chainspec.kernels.fused_moe import fused_moe, fused_moe_reference, pick_tiles
from chainspec.kernels.triton_support import kernels_on_cpu
from chainspec.models.moe import MoEConfig, RouterConfig, Scoring, SparseMoE


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    rows: tuple[tuple[str, int], ...]  # (case, rows)


DEEPSEEK_V3 = Shape(7168, 2048, 256, 8, 8, 4, rows=(
    ("decode", 1), ("decode", 8), ("verify", 32), ("prefill", 512), ("prefill", 2048)))
TINY = Shape(32, 16, 16, 4, 4, 2, rows=(("decode", 1), ("verify", 6), ("prefill", 40)))


def moe_layer(shape: Shape, ctx: Context) -> SparseMoE:
    router = RouterConfig(shape.experts, shape.top_k, Scoring.SIGMOID, True, shape.n_group,
                          shape.topk_group, routed_scaling_factor=2.5)
    cfg = MoEConfig(router, shape.hidden, shape.intermediate, shape.intermediate)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(ctx.dtype)  # built in the run's dtype: no fp32 copy of 22 GB
    try:
        with torch.device(ctx.device):
            layer = SparseMoE(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
        layer.gate.e_score_correction_bias.normal_(0.0, 0.01)  # fp32, as loaded
    return layer.eval()


def moe_section(ctx: Context, budget: Budget) -> dict:
    shape = TINY if ctx.dry_run else DEEPSEEK_V3
    on_cpu = kernels_on_cpu() if ctx.dry_run else contextlib.nullcontext()
    with on_cpu, torch.inference_mode():
        layer = moe_layer(shape, ctx)
        out = each_size(list(shape.rows), budget, lambda size: _measure(layer, *size, ctx))
    out.update(times="one MoE layer's routed experts (kernel_ms, reference_ms) and the whole "
                     "layer with the kernel (layer_ms: router + experts + shared expert)",
               dtype=str(ctx.dtype),
               shape=f"hidden {shape.hidden}, {shape.experts} experts x {shape.intermediate}, "
                     f"top-{shape.top_k}, groups {shape.topk_group}/{shape.n_group}")
    return out


def _measure(layer: SparseMoE, case: str, rows: int, ctx: Context) -> dict:
    x = torch.randn(rows, layer.cfg.hidden_size, device=ctx.device, dtype=ctx.dtype)
    ids, weights = layer.gate(x)
    w13, w2 = layer.experts.gate_up_proj, layer.experts.down_proj

    def kernel():
        return fused_moe(x, w13, w2, ids, weights)

    def reference():
        return fused_moe_reference(x, w13, w2, ids, weights)

    got, want = kernel(), reference()
    kernel_ms, ref_ms = median_ms(kernel, ctx), median_ms(reference, ctx)
    hit = int(torch.unique(ids).numel())
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    gbytes = hit * per_expert / 1e9
    scale = want.float().abs().max().item() or 1.0
    return {"case": case, "rows": rows, "experts_hit": hit,
            "block_m": pick_tiles(rows, ids.shape[1], w13.shape[0], x.dtype).block_m,
            "kernel_ms": kernel_ms, "reference_ms": ref_ms, "speedup": ref_ms / kernel_ms,
            "weights_GB": gbytes, "kernel_TBps": gbytes / kernel_ms,
            "max_rel_diff": (got.float() - want.float()).abs().max().item() / scale,
            "layer_ms": median_ms(lambda: layer(x), ctx)}

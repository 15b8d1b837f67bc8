"""Paged attention: the Triton kernel against its torch reference, alone and inside
synthetic decoder layers shaped like Llama-3-8B (random weights), at long contexts.

Each context gets its own random paged caches (blocks shuffled, as a running server
leaves them). Two row shapes: decode (1 row per sequence) and a verify window (4 rows
per sequence). Bandwidth is the K/V bytes the step must read over the kernel's time,
beside a measured device copy bandwidth (nominally ~4.3 TB/s on an H200)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from benchmarks.gpu.timing import Budget, Context, each_size, median_ms
from chainspec.kernels.kv_store import store_kv
from chainspec.kernels.paged_attention import paged_attention, paged_attention_reference
from chainspec.kernels.triton_support import kernels_on_cpu
from chainspec.models.config import ModelConfig
from chainspec.models.target import TargetModel

H200_COPY_TBPS = 4.3  # measured device-to-device copy bandwidth, for reference


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int  # sequences per step
    block_size: int
    contexts: tuple[tuple[int, int], ...]  # (context, layers)


LLAMA3_8B = Shape(4096, 14336, 32, 8, 128, batch=8, block_size=16,
                  contexts=((1024, 4), (8192, 4), (32768, 2)))
TINY = Shape(64, 128, 4, 2, 16, batch=2, block_size=16, contexts=((40, 2),))
CASES = (("decode", 1), ("verify", 4))  # rows per sequence


@dataclass
class PagedSetup:
    """One context's caches and per-step row description."""

    k_caches: list[torch.Tensor]  # per layer [blocks, block_size, Hkv, D]
    v_caches: list[torch.Tensor]
    tables: torch.Tensor  # [S, max_blocks] int32
    row_seq: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] slot = block * block_size + offset

    def kv_bytes_per_layer(self) -> int:
        """K and V bytes a step reads per layer: each sequence up to its last row."""
        per_pos = self.k_caches[0][0, 0].numel() * self.k_caches[0].element_size() * 2
        return int(self.positions.view(self.tables.shape[0], -1).amax(1).add(1).sum()) \
            * per_pos


def paged_setup(shape: Shape, context: int, layers: int, rows: int, ctx: Context
                ) -> PagedSetup:
    s, bs = shape.batch, shape.block_size
    per_seq = -(-context // bs)
    gen = torch.Generator(device=ctx.device).manual_seed(context)
    tables = torch.randperm(s * per_seq, generator=gen, device=ctx.device)
    tables = tables.view(s, per_seq).to(torch.int32)  # [S, max_blocks]

    def cache() -> torch.Tensor:
        return torch.randn(s * per_seq, bs, shape.kv_heads, shape.head_dim, generator=gen,
                           device=ctx.device, dtype=ctx.dtype)

    positions = torch.arange(context - rows, context, device=ctx.device).repeat(s)  # [T]
    row_seq = torch.arange(s, device=ctx.device).repeat_interleave(rows)  # [T]
    block = tables.long()[row_seq, positions // bs]
    return PagedSetup([cache() for _ in range(layers)], [cache() for _ in range(layers)],
                      tables, row_seq, positions, block * bs + positions % bs)


class PagedBackend:
    """An attention backend for `TargetModel` over paged caches: store, then attend."""

    def __init__(self, setup: PagedSetup, attend_fn, scale: float) -> None:
        self.setup, self.attend_fn, self.scale = setup, attend_fn, scale

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               *, scale: float | None = None, **options) -> torch.Tensor:
        del options  # full attention only (the Llama shapes this benchmark times)
        p = self.setup
        store_kv(k, v, p.k_caches[layer], p.v_caches[layer], p.slots)
        return self.attend_fn(q, p.k_caches[layer], p.v_caches[layer], p.tables, p.row_seq,
                              p.positions, self.scale if scale is None else scale)


def synthetic_model(shape: Shape, layers: int, ctx: Context) -> TargetModel:
    """Llama-shaped decoder layers with random weights (small vocabulary: the head is not
    timed)."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1024,
                      hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_layers=layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                      head_dim=shape.head_dim, max_position=max(c for c, _ in shape.contexts))
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = TargetModel(cfg)
    return model.to(ctx.dtype).eval()


def copy_tbps(ctx: Context) -> float:
    """Device copy bandwidth (read + write bytes / time) over a 1 GiB buffer."""
    n = (1 << 16) if ctx.dry_run else (1 << 29)
    src = torch.empty(n, dtype=torch.bfloat16, device=ctx.device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), ctx)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def attention_section(ctx: Context, budget: Budget) -> dict:
    shape = TINY if ctx.dry_run else LLAMA3_8B
    on_cpu = kernels_on_cpu() if ctx.dry_run else contextlib.nullcontext()
    with on_cpu, torch.inference_mode():
        copy_bw = copy_tbps(ctx)
        sizes = [(c, n, case, r) for c, n in shape.contexts for case, r in CASES]
        models: dict[int, TargetModel] = {}

        def measure(size: tuple) -> dict:
            context, layers, case, rows = size
            if layers not in models:
                models.clear()  # one model at a time on the device
                models[layers] = synthetic_model(shape, layers, ctx)
            row = _measure_case(shape, context, case, layers, rows, models[layers], ctx)
            return row | {"of_copy_bw": row["kernel_TBps"] / copy_bw}

        out = each_size(sizes, budget, measure)
    out.update(times="per layer: attention alone (kernel_ms, reference_ms), then a whole "
                     "decoder layer with each (layer_*_ms); kv_GB: K+V bytes one layer reads",
               copy_TBps=copy_bw, nominal_copy_TBps=H200_COPY_TBPS, dtype=str(ctx.dtype),
               shape=f"hidden {shape.hidden}, {shape.heads} q / {shape.kv_heads} kv heads, "
                     f"head_dim {shape.head_dim}, block {shape.block_size}, "
                     f"batch {shape.batch}")
    return out


def _measure_case(shape: Shape, context: int, case: str, layers: int, rows: int,
                  model: TargetModel, ctx: Context) -> dict:
    """One context and row shape; times per layer (attention alone, then a whole layer)."""
    setup = paged_setup(shape, context, layers, rows, ctx)
    scale = shape.head_dim ** -0.5
    t = setup.positions.shape[0]
    qs = [torch.randn(t, shape.heads, shape.head_dim, device=ctx.device, dtype=ctx.dtype)
          for _ in range(layers)]

    def attn(fn):
        return lambda: [fn(q, setup.k_caches[i], setup.v_caches[i], setup.tables,
                           setup.row_seq, setup.positions, scale) for i, q in enumerate(qs)]

    got, want = attn(paged_attention)()[0], attn(paged_attention_reference)()[0]
    kernel_ms = median_ms(attn(paged_attention), ctx) / layers
    ref_ms = median_ms(attn(paged_attention_reference), ctx) / layers
    ids = torch.randint(0, model.config.vocab_size, (t,), device=ctx.device)

    def forward(fn):
        return lambda: model(ids, setup.positions, PagedBackend(setup, fn, scale))

    fwd_kernel = median_ms(forward(paged_attention), ctx) / layers
    fwd_ref = median_ms(forward(paged_attention_reference), ctx) / layers
    gbytes = setup.kv_bytes_per_layer() / 1e9
    return {"context": context, "case": case, "layers": layers, "rows": t,
            "kernel_ms": kernel_ms, "reference_ms": ref_ms, "speedup": ref_ms / kernel_ms,
            "kv_GB": gbytes, "kernel_TBps": gbytes / kernel_ms,
            "max_abs_diff": (got.float() - want.float()).abs().max().item(),
            "layer_kernel_ms": fwd_kernel, "layer_reference_ms": fwd_ref}

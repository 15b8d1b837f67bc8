"""Randomised paged-attention / KV-store cases shared by the interpreter parity tests, the
reference-vs-dense tests and the GPU tests.

A case is a set of sequences, each with its cached length and the window of rows this step
(decode: 1 row at the end, verify: 2-8 rows, prefill chunk: many rows), packed into one
batch. Blocks are handed out shuffled; block-table entries past a sequence's blocks hold
an out-of-range block id, so any read past a sequence's last position fails loudly.
Windowed cases give back every block wholly below a sequence's lowest row's window: its
table entries point at one shared block full of NaN, which no row may read unmasked.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    head_dim: int
    group: int  # query heads per kv head
    windows: tuple[tuple[int, int], ...]  # per sequence: (first row's position, rows)
    kv_heads: int = 2
    block_size: int = 16
    padding_rows: int = 2
    interleave: bool = False  # rows of sequences shuffled in the packing
    cache_dtype: torch.dtype | None = None  # defaults to dtype
    strided_q: bool = False  # q a view into a wider qkv tensor
    seed: int = 0
    window: int | None = None  # sliding window W: row p sees keys p-W+1..p
    sinks: bool = False  # a random logit per query head in the softmax denominator
    v_dim: int | None = None  # value width (default head_dim)
    latent: bool = False  # values are a strided view of the keys' first v_dim channels
    extra: dict = field(default_factory=dict, compare=False)


def _decode_at(*positions: int) -> tuple[tuple[int, int], ...]:
    return tuple((p, 1) for p in positions)


CASES = [
    Case("decode_block_edges_f32", torch.float32, 64, 1, _decode_at(0, 15, 16, 17, 31, 32, 47)),
    Case("verify_gqa2_d128_f16", torch.float16, 128, 2,
         ((14, 3), (29, 4), (0, 2), (46, 8), (63, 5)), seed=1),
    Case("mixed_gqa4_d64_bf16", torch.bfloat16, 64, 4,
         ((0, 40), (37, 21), (70, 1), (15, 6), (95, 1)), seed=2),
    Case("mixed_gqa8_d128_bf16_bs8", torch.bfloat16, 128, 8,
         ((5, 4), (0, 19), (33, 1)), block_size=8, seed=3),
    Case("interleaved_rows_d32_f16", torch.float16, 32, 2,
         ((7, 5), (40, 1), (0, 9), (23, 3)), padding_rows=3, interleave=True, seed=4),
    Case("small_d16_bs64_f32", torch.float32, 16, 2, ((0, 30), (60, 8), (130, 1)),
         block_size=64, kv_heads=1, seed=5),
    Case("demo_shape_strided_q_f32_cache_f16", torch.float32, 32, 2,
         ((3, 1), (17, 4), (0, 12)), cache_dtype=torch.float16, strided_q=True, seed=6),
    Case("long_batch_block_m64_f16", torch.float16, 32, 1, ((0, 200), (150, 60), (9, 1)),
         kv_heads=1, padding_rows=1, seed=7),
    # sliding windows (blocks below them given back), sinks, value widths
    Case("window_sinks_decode_verify_f32", torch.float32, 32, 2,
         ((0, 1), (5, 1), (9, 3), (40, 1), (70, 4)), block_size=8, window=12, sinks=True,
         seed=8),
    Case("window_prefill_chunks_bf16", torch.bfloat16, 64, 4, ((0, 40), (37, 21), (95, 1)),
         window=16, seed=9),
    Case("window_longer_than_seq_sinks_f16", torch.float16, 32, 1, ((0, 5), (3, 2)),
         window=64, sinks=True, seed=10),
    Case("sinks_only_interleaved_f16", torch.float16, 32, 2, ((7, 5), (40, 1), (0, 9)),
         sinks=True, interleave=True, seed=11),
    Case("v_dim_24_of_48_window_f32", torch.float32, 48, 2, ((3, 2), (30, 6), (61, 1)),
         block_size=4, v_dim=24, window=9, sinks=True, seed=12),
    Case("latent_view_d40_v32_f16", torch.float16, 40, 8, ((0, 17), (20, 1), (33, 3)),
         kv_heads=1, v_dim=32, latent=True, seed=13),
    Case("window_1_gqa2_f32", torch.float32, 16, 2, ((0, 3), (20, 2)), block_size=4,
         window=1, seed=14),
]


def build(case: Case, device: str = "cpu") -> dict:
    """Inputs for `paged_attention(**out["args"])` plus each sequence's dense K/V."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, dim = case.block_size, case.kv_heads, case.head_dim
    lengths = [p + n for p, n in case.windows]  # cached positions after this step's store
    need = [(n + bs - 1) // bs for n in lengths]
    num_blocks = sum(need) + 3
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    bad = num_blocks + 1000  # NOTE: out of range on purpose; must never be read
    tables = torch.full((len(lengths), max(need) + 2), bad, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    cache_dtype = case.cache_dtype or case.dtype
    v_dim = case.v_dim or dim
    k_cache = torch.randn(num_blocks, bs, hkv, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, v_dim, generator=gen).to(cache_dtype)
    if case.latent:
        v_cache = k_cache[..., :v_dim]  # strided: the keys' leading channels
    if case.window is not None:
        _give_back(case, tables, k_cache, v_cache, perm[0])
    rows = [(s, p + i) for s, (p, n) in enumerate(case.windows) for i in range(n)]
    rows += [(-1, 0)] * case.padding_rows
    if case.interleave:
        rng.shuffle(rows)
    else:  # padding rows in the middle and at the end
        mid = len(rows) // 2
        rows = rows[:mid] + rows[-1:] + rows[mid:-1]
    t, hq = len(rows), hkv * case.group
    q = torch.randn(t, (hq + 2 * hkv) * dim, generator=gen).to(case.dtype)
    q = q[:, : hq * dim]  # [T, Hq * D], a strided view into the wider "qkv" rows
    q = q.view(t, hq, dim) if case.strided_q else q.reshape(t, hq, dim)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                row_seq=torch.tensor([s for s, _ in rows]),
                positions=torch.tensor([p for _, p in rows]), scale=dim ** -0.5)
    if case.window is not None:
        args["window"] = case.window
    if case.sinks:
        args["sinks"] = torch.randn(hq, generator=gen) * 2.0
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    if case.latent:  # .to(device) copies; keep the view a view
        args["v_cache"] = args["k_cache"][..., :v_dim]
    return dict(args=args, lengths=lengths)


def _give_back(case: Case, tables: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, spare: int) -> None:
    """Entries of blocks wholly below each sequence's first row's window now point at
    one spare block, filled with NaN (as the engine's trimmed tables point at block 0)."""
    k_cache[spare] = float("nan")
    if not case.latent:
        v_cache[spare] = float("nan")
    for s, (p, _) in enumerate(case.windows):
        below = max(0, p - case.window + 1) // case.block_size
        tables[s, :below] = spare


def dense_oracle(args: dict) -> torch.Tensor:
    """Independent oracle: each row's keys gathered position by position into a contiguous
    [L, Hkv, D] (only those in its window), GQA by repeating kv heads, plain softmax
    attention in fp64 (a sink: one more logit, whose weight is dropped)."""
    q, k_cache, v_cache = args["q"], args["k_cache"], args["v_cache"]
    tables, bs = args["block_tables"], k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    window, sinks = args.get("window"), args.get("sinks")
    out = torch.zeros(*q.shape[:2], v_cache.shape[-1], dtype=torch.float64)
    for t in range(q.shape[0]):
        seq, pos = int(args["row_seq"][t]), int(args["positions"][t])
        if seq < 0:
            continue
        lo = 0 if window is None else max(0, pos - window + 1)
        idx = [(int(tables[seq, p // bs]), p % bs) for p in range(lo, pos + 1)]
        keys = torch.stack([k_cache[b, o] for b, o in idx]).double().repeat_interleave(group, 1)
        vals = torch.stack([v_cache[b, o] for b, o in idx]).double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), keys) * args["scale"]
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        probs = scores.softmax(-1)[:, :len(idx)]
        out[t] = torch.einsum("hl,lhd->hd", probs, vals)
    return out


def run_kernel_parity() -> dict[str, float]:
    """Child-process entry (TRITON_INTERPRET=1): kernel vs reference, max abs error per case."""
    from chainspec.kernels.paged_attention import paged_attention, paged_attention_reference
    from chainspec.kernels.triton_support import kernels_on_cpu

    errors = {}
    for case in CASES:
        args = build(case)["args"]
        with kernels_on_cpu():
            got = paged_attention(**args)
        want = paged_attention_reference(**args)
        assert got.dtype == want.dtype and got.shape == want.shape
        errors[case.name] = (got.double() - want.double()).abs().max().item()
        pad = args["row_seq"] < 0
        errors[case.name + "/padding"] = got[pad].abs().max().item()
    return errors


def paged_from_dense(seed: int, window: int | None, sinks: bool, lengths: tuple[int, ...] = (
        23, 9), hkv: int = 2, group: int = 2, dk: int = 24, dv: int = 16, bs: int = 4
        ) -> tuple[dict, torch.Tensor]:
    """Whole sequences (prefill rows) written block by block into a shuffled cache, the
    `paged_attention` args over them and `kernels/dense_attention.py`'s output on the
    same dense q/k/v (`[T, Hq, Dv]` rows, packed in sequence order)."""
    from chainspec.kernels.dense_attention import dense_attention

    gen = torch.Generator().manual_seed(seed)
    t_max, hq = max(lengths), hkv * group
    q = torch.randn(len(lengths), hq, t_max, dk, generator=gen)
    k = torch.randn(len(lengths), hkv, t_max, dk, generator=gen)
    v = torch.randn(len(lengths), hkv, t_max, dv, generator=gen)
    sink = torch.randn(hq, generator=gen) if sinks else None
    dense = [dense_attention(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                             dk ** -0.5, window, sink)[0].transpose(0, 1)
             for i, n in enumerate(lengths)]  # [n, Hq, Dv] each
    need = [(n + bs - 1) // bs for n in lengths]
    perm = torch.randperm(sum(need), generator=gen)
    k_cache = torch.zeros(sum(need), bs, hkv, dk)
    v_cache = torch.zeros(sum(need), bs, hkv, dv)
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    for i, n in enumerate(lengths):
        own = perm[sum(need[:i]):sum(need[:i + 1])]
        tables[i, :len(own)] = own.int()
        for p in range(n):
            k_cache[own[p // bs], p % bs] = k[i, :, p]
            v_cache[own[p // bs], p % bs] = v[i, :, p]
    args = dict(q=torch.cat([q[i, :, :n].transpose(0, 1) for i, n in enumerate(lengths)]),
                k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                row_seq=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
                positions=torch.cat([torch.arange(n) for n in lengths]), scale=dk ** -0.5,
                window=window, sinks=sink)
    return args, torch.cat(dense)

"""Every Triton kernel compiles ahead of time to sm_80 and sm_90 cubin with Triton's own
compiler (no GPU needed) and fits the target: a non-empty cubin, shared memory within the
per-block limit, at most 255 registers per thread and no spills.

Kernel authors: add one `AotCase` per representative variant to CASES (the kernel named as
"module:attribute" so this file imports without triton); each runs on both targets. Pass
the launch's num_warps/num_stages, and name in `divisible` the int arguments (strides) that
are multiples of 16 at run time, as Triton's launcher specialises them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.kernels.support import require_triton

CAPABILITIES = (80, 90)


@dataclass(frozen=True)
class AotCase:
    """One kernel variant: runtime argument types and constexpr values, as at a launch."""

    name: str  # test id
    kernel: str  # "chainspec.kernels.module:kernel_attr"
    signature: dict[str, str]  # runtime args: {"x": "*fp16", "n": "i32"}
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    divisible: tuple[str, ...] = ()  # int args that are multiples of 16 at run time

    def load(self) -> Any:
        module, attr = self.kernel.split(":")
        return getattr(importlib.import_module(module), attr)


_QUANT = "chainspec.kernels.hidden_quant:"
CASES: list[AotCase] = [
    AotCase("quantize_int8_bf16", _QUANT + "_quantize_kernel",
            {"x_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32", "H": "i32",
             "stride_x": "i32"}, {"QMAX": 127.0, "FP8": False, "BLOCK": 4096}),
    AotCase("quantize_fp8_fp32", _QUANT + "_quantize_kernel",
            {"x_ptr": "*fp32", "q_ptr": "*u8", "scale_ptr": "*fp32", "H": "i32",
             "stride_x": "i32"}, {"QMAX": 448.0, "FP8": True, "BLOCK": 4096}),
    AotCase("dequantize_fp8_bf16", _QUANT + "_dequantize_kernel",
            {"q_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": "*bf16", "H": "i32",
             "stride_q": "i32"}, {"FP8": True, "BLOCK": 4096}),
    AotCase("dequantize_int8_fp32", _QUANT + "_dequantize_kernel",
            {"q_ptr": "*i8", "scale_ptr": "*fp32", "out_ptr": "*fp32", "H": "i32",
             "stride_q": "i32"}, {"FP8": False, "BLOCK": 4096}),
]
_MTP = {"emb_ptr": "*bf16", "hid_ptr": "*bf16", "we_ptr": "*bf16", "wh_ptr": "*bf16",
        "u_ptr": "*bf16", "H": "i32", "stride_e": "i32", "stride_h": "i32", "eps": "fp32"}
CASES += [
    AotCase("mtp_input_bf16_h7168", "chainspec.kernels.mtp_input:_mtp_input_kernel", _MTP,
            {"UNIT_OFFSET": False, "HIDDEN_FIRST": False, "IS_FP32": False, "BLOCK": 8192},
            num_warps=16),
    AotCase("mtp_input_fp32_offset", "chainspec.kernels.mtp_input:_mtp_input_kernel",
            {k: v.replace("bf16", "fp32") for k, v in _MTP.items()},
            {"UNIT_OFFSET": True, "HIDDEN_FIRST": True, "IS_FP32": True, "BLOCK": 4096},
            num_warps=8),
]
_ACCEPT = "chainspec.kernels.acceptance:"
_SAMPLED = {"p_ptr": "*fp32", "drafts_ptr": "*i64", "sup_ptr": "*i64", "q_ptr": "*fp32",
            "nd_ptr": "*i64", "u_ptr": "*fp32", "noise_ptr": "*fp32", "acc_ptr": "*i64",
            "tok_ptr": "*i64", "K": "i32", "V": "i32", "TOPK": "i32"}
CASES += [
    AotCase("accept_greedy_bf16", _ACCEPT + "_greedy_kernel",
            {"logits_ptr": "*bf16", "drafts_ptr": "*i64", "nd_ptr": "*i64", "acc_ptr": "*i64",
             "bonus_ptr": "*i64", "K": "i32", "V": "i32"}, {"BLOCK_V": 4096}, num_warps=8),
    AotCase("accept_sampled_topk8", _ACCEPT + "_sampled_kernel", _SAMPLED,
            {"HAS_SUPPORT": True, "TOP": 8, "BLOCK_V": 2048}, num_warps=8),
    AotCase("accept_sampled_point_mass", _ACCEPT + "_sampled_kernel", _SAMPLED,
            {"HAS_SUPPORT": False, "TOP": 2, "BLOCK_V": 4096}, num_warps=8),
]



def _pad(dim: int) -> int:
    return max(16, 1 << (dim - 1).bit_length())


def _attention(dtype: str, head_dim: int, group: int, block_m: int, v_dim: int | None = None,
               window: bool = False, sinks: bool = False, num_warps: int | None = None
               ) -> AotCase:
    """`v_dim`, `window`, `sinks`: the sliding-window kind's options (MiMo-V2: keys 192,
    values 128, window and sinks on one kernel)."""
    v_dim = v_dim or head_dim
    ptrs = dict.fromkeys(("q_ptr", "kc_ptr", "vc_ptr", "out_ptr"), f"*{dtype}")
    ptrs.update(dict.fromkeys(("tables_ptr", "order_ptr", "start_ptr", "count_ptr",
                               "tile_seq_ptr", "tile_first_ptr"), "*i32"), pos_ptr="*i64",
                sinks_ptr="*fp32")
    strides = dict.fromkeys(("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb",
                             "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
                             "stride_bt"), "i32")  # all but stride_bt multiples of 16
    options = (f"_v{v_dim}" if v_dim != head_dim else "") + ("_window" if window else "") + (
        "_sinks" if sinks else "")
    return AotCase(f"paged_attention_{dtype}_d{head_dim}_g{group}_m{block_m}{options}",
                   "chainspec.kernels.paged_attention:_paged_attention_kernel",
                   {**ptrs, "scale_log2": "fp32", "window": "i32", **strides},
                   dict(GROUP=group, HEAD_DIM=head_dim, V_DIM=v_dim, DK_PAD=_pad(head_dim),
                        DV_PAD=_pad(v_dim), BLOCK_SIZE=16, BLOCK_M=block_m, TILE_N=32,
                        DOT_FP32=dtype == "fp32", HAS_WINDOW=window, HAS_SINKS=sinks),
                   num_warps=num_warps or (8 if dtype == "fp32" else 4), num_stages=2,
                   divisible=tuple(strides)[:-1])


def _store_kv(dtype: str, head_dim: int, heads: int, v_dim: int | None = None) -> AotCase:
    sig = {**dict.fromkeys(("k_ptr", "v_ptr", "kc_ptr", "vc_ptr"), f"*{dtype}"),
           "slot_ptr": "*i64",
           **dict.fromkeys(("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kcb",
                            "stride_kcs", "stride_kch", "stride_vcb", "stride_vcs",
                            "stride_vch", "num_heads"), "i32")}
    v_dim = v_dim or head_dim
    pad = 1 << (head_dim - 1).bit_length(), 1 << (v_dim - 1).bit_length()
    return AotCase(f"store_kv_{dtype}_d{head_dim}_v{v_dim}_h{heads}",
                   "chainspec.kernels.kv_store:_store_kv_kernel", sig,
                   dict(BLOCK_SIZE=16, HEADS=heads, HEAD_DIM=head_dim, V_DIM=v_dim,
                        DK_PAD=pad[0], DV_PAD=pad[1]), num_warps=4,
                   divisible=tuple(sig)[5:-1])


CASES += [
    _attention("bf16", 128, 8, 64),  # prefill-sized tiles, the widest GQA group
    _attention("fp16", 128, 1, 16),  # decode/verify tiles
    _attention("fp16", 64, 4, 64),
    _attention("bf16", 64, 2, 16),
    _attention("fp32", 128, 8, 16),  # fp32 dots (ieee): tiles stay at 16 rows x heads
    # MiMo-V2-Flash's sliding layers (keys 192 padded to 256, values 128, window, sinks)
    _attention("bf16", 192, 8, 64, v_dim=128, window=True, sinks=True),
    _attention("bf16", 192, 16, 16, v_dim=128, window=True, sinks=True),
    _attention("fp16", 64, 2, 16, window=True),
    _attention("fp32", 64, 4, 16, v_dim=32, window=True, sinks=True),
    _attention("bf16", 576, 16, 16, v_dim=512, num_warps=8),  # a latent cache (MLA)
    _store_kv("bf16", 128, 8),
    _store_kv("fp16", 64, 4),
    _store_kv("bf16", 192, 8, v_dim=128),  # MiMo-V2-Flash's sliding layers
]


def _gdn_conv(dtype: str, pool: str, kernel: int) -> AotCase:
    sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "pool_ptr": f"*{pool}",
           "out_ptr": "*fp32", **dict.fromkeys(("starts_ptr", "slot_ptr", "src_ptr",
                                                "keep_ptr"), "*i64"),
           "C": "i32", "stride_ps": "i32", "stride_pr": "i32"}
    return AotCase(f"gdn_conv1d_{dtype}_pool_{pool}_k{kernel}",
                   "chainspec.kernels.gated_delta:_conv1d_rows_kernel", sig,
                   dict(KERNEL=kernel, BLOCK_C=256), num_warps=4, num_stages=3,
                   divisible=("C", "stride_ps", "stride_pr"))


def _gdn_rule(pool: str, dk: int, dv: int, group: int, heads: int) -> AotCase:
    """Qwen3.5 / Qwen3-Next: Dk = Dv = 128, 16 key heads, 32 or 48 value heads."""
    sig = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr"), "*fp32"),
           "pool_ptr": f"*{pool}", "out_ptr": "*fp32",
           **dict.fromkeys(("starts_ptr", "slot_ptr", "src_ptr", "keep_ptr"), "*i64"),
           "scale": "fp32", **dict.fromkeys(("stride_qt", "stride_qh", "stride_kt",
                                              "stride_kh", "stride_vt", "stride_vh",
                                              "stride_ps", "stride_pr"), "i32")}
    return AotCase(f"gdn_delta_rule_pool_{pool}_dk{dk}_dv{dv}_g{group}",
                   "chainspec.kernels.gated_delta:_delta_rule_rows_kernel", sig,
                   dict(GROUP=group, HV=heads, DK=dk, DV=dv,
                        DK_PAD=1 << (dk - 1).bit_length(), BLOCK_V=min(32, dv), EPS=1e-6),
                   num_warps=4, num_stages=3, divisible=tuple(sig)[-8:])


CASES += [
    _gdn_conv("bf16", "bf16", 4),  # Qwen3.5 (conv kernel 4)
    _gdn_conv("fp32", "fp32", 4),
    _gdn_conv("fp16", "fp16", 2),
    _gdn_rule("bf16", 128, 128, 2, 32),
    _gdn_rule("fp32", 128, 128, 3, 48),
    _gdn_rule("bf16", 256, 128, 1, 16),  # a wider key head: the state [256, 32] still fits
    _gdn_rule("fp16", 96, 64, 2, 8),  # no power of two: masked lanes
]


def _moe_gemm(dtype: str, gated: bool, block_m: int, block_k: int = 64,
              clamp: bool = False) -> AotCase:
    """One of fused MoE's two grouped GEMMs (gate/up with SiLU, or down with the weights);
    the tiles `fused_moe.pick_tiles` launches (decode: 16 rows, prefill: 64)."""
    out = dtype if gated else "fp32"
    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{out}", "w_ptr": "*fp32",
           "pairs_ptr": "*i32", "block_expert_ptr": "*i32", "total_ptr": "*i32",
           "N": "i32", "K": "i32", "num_pairs": "i32", "stride_am": "i32",
           "stride_be": "i32", "stride_bn": "i32", "stride_cm": "i32", "limit": "fp32"}
    return AotCase(f"moe_{'gate_up' if gated else 'down'}_{dtype}_m{block_m}"
                   f"{'_clamp' if clamp else ''}",
                   "chainspec.kernels.fused_moe:_moe_gemm_kernel", sig,
                   dict(A_DIV=8 if gated else 1, GATED=gated, CLAMP=clamp, BLOCK_M=block_m,
                        BLOCK_N=64, BLOCK_K=block_k, DOT_FP32=dtype == "fp32"),
                   num_warps=4, num_stages=3, divisible=("N", "K", *tuple(sig)[-5:-1]))


CASES += [  # DeepSeek-V3 experts: H 7168, I 2048 (N, K and strides multiples of 16)
    _moe_gemm("bf16", True, 16),
    _moe_gemm("bf16", True, 64),
    _moe_gemm("bf16", False, 16),
    _moe_gemm("bf16", False, 64),
    _moe_gemm("fp16", True, 64),
    _moe_gemm("fp32", True, 16, block_k=32),
    _moe_gemm("fp32", False, 16, block_k=32),  # fp32: 16-row tiles only (pick_tiles)
    _moe_gemm("bf16", True, 64, clamp=True),  # Step-3.5's clamped routed experts
]

@pytest.mark.parametrize("cap", CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_compiles_within_target_limits(case: AotCase, cap: int) -> None:
    require_triton()
    from chainspec.kernels.triton_support import aot_compile

    result = aot_compile(case.load(), case.signature, case.constexprs, cap,
                         num_warps=case.num_warps, num_stages=case.num_stages,
                         divisible=case.divisible)
    assert result.num_warps == case.num_warps
    assert result.registers is not None, "cuobjdump could not read the cubin's registers"
    assert result.problems() == [], f"{case.name} on sm_{cap}: {result.problems()}"


def test_limits_are_reported() -> None:
    from chainspec.kernels.triton_support import AotResult

    fits = AotResult("k", 80, b"\x7fELF", 163 * 1024, 4, 255, 0)
    assert fits.problems() == []
    assert len(AotResult("k", 80, b"", 163 * 1024 + 1, 4, 256, 8).problems()) == 4
    assert AotResult("k", 90, b"x", 200 * 1024, 4, None, None).problems() == []

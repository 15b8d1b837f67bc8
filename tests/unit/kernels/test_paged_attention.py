"""Paged attention: the torch reference against an independent dense oracle, the Triton
kernel (Triton's interpreter, in a child process) against the reference on randomised
mixed batches, and the kernel's host-side tiling plan.

Cases (attention_cases.py) cover decode rows at block edges, verify windows, prefill
chunks, padding rows, GQA 1/2/4/8, head dims 16/32/64/128, block sizes 8/16/64, shuffled
blocks with out-of-range table entries past each sequence, interleaved packing, a strided q,
a cache dtype unlike q's, and a batch large enough for 64-row tiles.
"""

from __future__ import annotations

import sys

import pytest
import torch

from chainspec.kernels.paged_attention import (
    _plan,
    paged_attention,
    paged_attention_reference,
)
from chainspec.kernels.triton_support import use_kernel
from tests.unit.kernels.attention_cases import CASES, TOLERANCE, build, dense_oracle
from tests.unit.kernels.interpreted import check_names as _check_names
from tests.unit.kernels.interpreted import interpreted_results


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_dense_oracle(case) -> None:
    args = build(case)["args"]
    got = paged_attention(**args)  # CPU tensors: the dispatch takes the reference
    assert got.dtype == args["q"].dtype and got.shape == args["q"].shape
    want = dense_oracle(args)
    pad = args["row_seq"] < 0
    assert torch.all(got[pad] == 0), "padding rows must return zeros"
    err = (got.double() - want).abs().max().item()
    assert err <= TOLERANCE[case.dtype], f"{case.name}: max error {err}"


def test_rows_see_only_their_sequence_and_positions() -> None:
    """Changing a key past a row's position, or in another sequence's blocks, leaves the
    row's output unchanged; changing one at its position changes it."""
    case = CASES[1]
    args = build(case)["args"]
    base = paged_attention_reference(**args)
    t = 0
    seq, pos = int(args["row_seq"][t]), int(args["positions"][t])
    bs = args["k_cache"].shape[1]
    for later, changes in ((1, False), (0, True)):
        p = pos + later
        k_cache = args["k_cache"].clone()
        k_cache[int(args["block_tables"][seq, p // bs]), p % bs] += 1.0
        out = paged_attention_reference(**{**args, "k_cache": k_cache})
        assert torch.equal(out[t], base[t]) != changes
    other = args["k_cache"].clone()
    other[[b for b in range(other.shape[0]) if b not in args["block_tables"][seq]]] = 7.0
    assert torch.equal(paged_attention_reference(**{**args, "k_cache": other})[t], base[t])


def test_cpu_tensors_take_the_reference() -> None:
    assert not use_kernel(torch.zeros(1))


def test_bad_shapes_are_refused() -> None:
    args = build(CASES[0])["args"]
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(**{**args, "positions": args["positions"][:-1]})
    with pytest.raises(ValueError, match="paged_attention"):
        paged_attention(**{**args, "q": args["q"][..., :-1]})


@pytest.mark.parametrize("block_q", [1, 2, 16])
def test_plan_covers_every_row_once_with_one_sequence_per_tile(block_q: int) -> None:
    gen = torch.Generator().manual_seed(block_q)
    num_seqs = 6
    row_seq = torch.randint(-1, num_seqs - 1, (53,), generator=gen)  # seq 5 has no rows
    order, start, count, tile_seq, tile_first = _plan(row_seq, num_seqs, block_q)
    seen = []
    for s, first in zip(tile_seq.tolist(), tile_first.tolist(), strict=True):
        n = int(count[s])
        if first >= n:
            continue  # a spare program: exits
        rows = order[int(start[s]) + first: int(start[s]) + min(first + block_q, n)]
        assert torch.all(row_seq[rows.long()] == s)
        seen += rows.tolist()
    valid = (row_seq >= 0).nonzero().squeeze(1).tolist()
    assert sorted(seen) == valid


def _make_check(case):
    def check() -> None:
        args = build(case)["args"]
        got = paged_attention(**args)  # inside kernels_on_cpu(): the Triton kernel
        want = paged_attention_reference(**args)
        assert got.dtype == want.dtype and got.shape == want.shape
        pad = args["row_seq"] < 0
        assert torch.all(got[pad] == 0), "padding rows must return zeros"
        err = (got.double() - want.double()).abs().max().item()
        assert err <= TOLERANCE[case.dtype], f"{case.name}: kernel vs reference {err}"
    return check


for _case in CASES:
    globals()[f"check_{_case.name}"] = _make_check(_case)

interpreted = interpreted_results(__name__)


@pytest.mark.parametrize("name", _check_names(sys.modules[__name__]))
def test_kernel_matches_reference_in_interpreter(name: str, interpreted: dict[str, str]
                                                 ) -> None:
    assert interpreted[name] == "", interpreted[name]

"""Paged attention: the torch reference against an independent dense oracle, the Triton
kernel (Triton's interpreter, in a child process) against the reference on randomised
mixed batches, and the kernel's host-side tiling plan.

Cases (attention_cases.py) cover decode rows at block edges, verify windows, prefill
chunks, padding rows, GQA 1/2/4/8, head dims 16/32/64/128, block sizes 8/16/64, shuffled
blocks with out-of-range table entries past each sequence, interleaved packing, a strided q,
a cache dtype unlike q's, a batch large enough for 64-row tiles, and the layer kinds'
options: sliding windows whose given-back blocks hold NaN, sinks, value widths unlike the
keys' (own tensor or a strided view of the keys: MLA's latent cache), head widths that
are no power of two.
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
from tests.unit.kernels.attention_cases import (
    CASES,
    TOLERANCE,
    build,
    dense_oracle,
    paged_from_dense,
)
from tests.unit.kernels.interpreted import check_names as _check_names
from tests.unit.kernels.interpreted import interpreted_results


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_dense_oracle(case) -> None:
    args = build(case)["args"]
    got = paged_attention(**args)  # CPU tensors: the dispatch takes the reference
    want = dense_oracle(args)
    assert got.dtype == args["q"].dtype and got.shape == want.shape
    assert not got.isnan().any(), "a given-back (NaN) block reached the output"
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


DENSE_OPTIONS = [(None, False), (5, False), (5, True), (None, True), (1, True), (40, True)]


@pytest.mark.parametrize(("window", "sinks"), DENSE_OPTIONS)
def test_reference_matches_dense_attention(window: int | None, sinks: bool) -> None:
    """Whole sequences through the paged reference equal kernels/dense_attention.py (the
    training and oracle path) with the same window, sinks and value width."""
    args, want = paged_from_dense(window or 0, window, sinks)
    got = paged_attention(**args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def check_kernel_matches_dense_attention() -> None:
    for window, sinks in DENSE_OPTIONS:
        args, want = paged_from_dense(window or 0, window, sinks)
        got = paged_attention(**args)  # inside kernels_on_cpu(): the Triton kernel
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_window_and_sinks_change_the_output() -> None:
    """The options are not ignored: a window or sinks move rows that see past them."""
    plain, _ = paged_from_dense(3, None, False)
    base = paged_attention(**plain)
    for window, sinks in ((5, False), (None, True)):
        args, _ = paged_from_dense(3, window, sinks)
        moved = (paged_attention(**args) - base).abs().amax((1, 2))  # [T]
        assert moved.max() > 1e-2
        if window is not None:  # rows 0..window-1 of each sequence see their whole past
            assert moved[:window].max() < 1e-5


def test_sinks_of_the_wrong_size_are_refused() -> None:
    args, _ = paged_from_dense(0, None, True)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(**{**args, "sinks": args["sinks"][:-1]})


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
        assert not got.isnan().any(), "a given-back (NaN) block reached the output"
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

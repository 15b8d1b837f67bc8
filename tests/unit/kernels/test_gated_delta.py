"""Gated DeltaNet kernels (Triton's interpreter, in a child process) against the layer's
torch form (models/gated_deltanet.py: the row form, and the chunked form for long
prefill spans): the outputs of every row and the whole state pools after the step.

Randomised batches mix what a step carries: prefill spans short and long (>= the
chunked threshold) from zero or from a kept row, verify windows keeping every row whose
`src` is one of the rows they overwrite, decode rows, padding sequences (slot -1: write
nothing, output zero) and padding rows past every span. Pools start random, so a state
written to the wrong slot or row, or read from zero instead of `src`, shows. Shapes
cover conv kernels 2/3/4, GQA groups 1/2, head widths no power of two and several
channel / value blocks per program."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

import pytest
import torch

from chainspec.kernels import gated_delta
from chainspec.models.gated_deltanet import CHUNKED_FROM, GatedDeltaNet, GDNShape
from chainspec.models.recurrent import PooledStates, StateRows
from tests.unit.kernels.interpreted import check_names as _check_names
from tests.unit.kernels.interpreted import interpreted_results

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter run of the check_* below
    gated_delta.BLOCK_C = 16  # several channel blocks per sequence
    gated_delta.BLOCK_V = 4  # several value blocks per head

KEPT_ROWS = 4  # K + 1 with K = 3
SLOTS = 5


@dataclass(frozen=True)
class Shape:
    name: str
    hk: int
    hv: int
    dk: int
    dv: int
    conv: int
    dtype: torch.dtype = torch.float32


SHAPES = [
    Shape("hk2_hv4_dk8_dv6_conv4", 2, 4, 8, 6, 4),
    Shape("hk1_hv1_dk12_dv8_conv3", 1, 1, 12, 8, 3),
    Shape("hk2_hv2_dk16_dv5_conv2", 2, 2, 16, 5, 2),
    Shape("hk1_hv2_dk8_dv8_conv4_bf16", 1, 2, 8, 8, 4, torch.bfloat16),
]
SEEDS = (0, 1)
# bf16: pools hold rounded states (the interpreter truncates, the reference rounds)
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -6}


def _layer(shape: Shape, gen: torch.Generator) -> GatedDeltaNet:
    s = GDNShape(shape.hk, shape.hv, shape.dk, shape.dv, shape.conv)
    layer = GatedDeltaNet(16, s, layer_id=0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return layer.to(shape.dtype)


def _seqs(gen: torch.Generator) -> list[tuple[int, int, bool, int]]:
    """(slot, src, keep, rows) per sequence: a long prefill, a verify window whose src is
    a row it rewrites, padding, then random ones; slots distinct."""
    slots = torch.randperm(SLOTS, generator=gen).tolist()
    seqs = [(slots[0], -1, False, CHUNKED_FROM + 3), (slots[1], 2, True, KEPT_ROWS),
            (-1, 1, True, 2)]
    for slot in slots[2:]:
        keep = bool(torch.randint(0, 2, (), generator=gen))
        n = int(torch.randint(1, KEPT_ROWS + 1 if keep else 2 * CHUNKED_FROM, (),
                              generator=gen))
        src = int(torch.randint(-1, KEPT_ROWS, (), generator=gen))
        seqs.append((slot, src, keep, n))
    order = torch.randperm(len(seqs), generator=gen).tolist()
    return [seqs[i] for i in order]


def _case(shape: Shape, seed: int):
    gen = torch.Generator().manual_seed(seed)
    layer = _layer(shape, gen)
    seqs = _seqs(gen)
    spans, first = [], 0
    for *_, n in seqs:
        spans.append((first, first + n))
        first += n
    rows = StateRows.build([(slot, src, keep) for slot, src, keep, _ in seqs], spans)
    t = first + 2  # two padding rows past every span
    x = torch.randn(t, 16, generator=gen).to(shape.dtype)
    pools = tuple(torch.randn(SLOTS, KEPT_ROWS, *p, generator=gen).to(shape.dtype)
                  for p in layer.cache_spec().shapes)
    return layer, x, rows, pools


def _gates(layer: GatedDeltaNet, x: torch.Tensor):
    """What forward hands its core: conv inputs, log decay, beta."""
    mixed, _, b, a = layer.project(x)
    log_decay = -layer.A_log.float().exp() * torch.nn.functional.softplus(
        a.float() + layer.dt_bias.float())
    return mixed, log_decay, b.float().sigmoid()


def _check_parity(shape: Shape, seed: int) -> None:
    layer, x, rows, pools = _case(shape, seed)
    with torch.no_grad():
        gates = _gates(layer, x)
        want_pools = tuple(p.clone() for p in pools)
        want = layer._core_reference(PooledStates(want_pools, rows), *gates)
        got = layer._core_kernel(PooledStates(pools, rows), *gates)
    tol = TOL[shape.dtype]
    pad = torch.ones(x.shape[0], dtype=torch.bool)
    for (lo, hi), slot in zip(rows.spans, rows.slots, strict=True):
        pad[lo:hi] = slot < 0
    assert torch.all(got[pad] == 0), "padding rows must come out zero"
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for part, (g, w) in enumerate(zip(pools, want_pools, strict=True)):
        torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol,
                                   msg=lambda m, part=part: f"pool part {part}: {m}")


def _make_check(shape: Shape, seed: int):
    def check() -> None:
        _check_parity(shape, seed)
    return check


for _shape in SHAPES:
    for _seed in SEEDS:
        globals()[f"check_{_shape.name}_seed{_seed}"] = _make_check(_shape, _seed)


def check_forward_dispatches_to_the_kernels() -> None:
    """Inside kernels_on_cpu() (as on CUDA), forward with a pooled backend calls the
    kernels, and its output equals the torch path's through the same norm and out_proj."""
    layer, x, rows, pools = _case(SHAPES[0], 7)
    calls = []
    conv, rule = gated_delta.conv1d_rows, gated_delta.delta_rule_rows

    def counted(fn):
        def call(*args):
            calls.append(fn.__name__)
            return fn(*args)
        return call

    class Backend:
        def __init__(self, pool):
            self.pool = pool

        def recurrent(self, layer_id):
            return PooledStates(self.pool, rows)

    want_pools = tuple(p.clone() for p in pools)
    gated_delta.conv1d_rows, gated_delta.delta_rule_rows = counted(conv), counted(rule)
    try:
        with torch.no_grad():
            got = layer(x, None, Backend(pools))
    finally:
        gated_delta.conv1d_rows, gated_delta.delta_rule_rows = conv, rule
    assert calls == ["conv1d_rows", "delta_rule_rows"], calls
    with torch.no_grad():
        _, z, _, _ = layer.project(x)
        core = layer._core_reference(PooledStates(want_pools, rows), *_gates(layer, x))
        want = layer.out_proj(layer.norm(core, z).reshape(x.shape[0], -1))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def next_step(rows: StateRows, device: torch.device | str = "cpu") -> StateRows:
    """The same spans and slots, every src moved, keep flipped where the span fits."""
    seqs = [(slot, (src + 2) % KEPT_ROWS - 1, not keep if hi - lo <= KEPT_ROWS else keep)
            for slot, src, keep, (lo, hi) in zip(rows.slots, rows.src, rows.keep,
                                                  rows.spans, strict=True)]
    return StateRows.build(seqs, rows.spans, device)


def check_kernels_read_only_the_device_tensors() -> None:
    """A captured graph keeps the host fields of its capture step: with them stale and
    the device tensors of the next step, the kernels compute the next step."""
    layer, x, rows, pools = _case(SHAPES[0], 3)
    fresh = next_step(rows)
    stale = dataclasses.replace(fresh, slots=rows.slots, src=rows.src, keep=rows.keep)
    assert stale.src != fresh.src and stale.keep != fresh.keep
    with torch.no_grad():
        gates = _gates(layer, x)
        want_pools = tuple(p.clone() for p in pools)
        want = layer._core_reference(PooledStates(want_pools, fresh), *gates)
        got = layer._core_kernel(PooledStates(pools, stale), *gates)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for g, w in zip(pools, want_pools, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


interpreted = interpreted_results(__name__)


@pytest.mark.parametrize("name", _check_names(sys.modules[__name__]))
def test_kernels_match_the_torch_form(name: str, interpreted: dict[str, str]) -> None:
    assert interpreted[name] == "", interpreted[name]


def test_cases_cover_what_a_step_mixes() -> None:
    """The randomised batches hold every kind of sequence the kernels tell apart."""
    kinds = set()
    for seed in SEEDS:
        _, _, rows, _ = _case(SHAPES[0], seed)
        for (lo, hi), slot, src, keep in zip(rows.spans, rows.slots, rows.src, rows.keep,
                                             strict=True):
            kinds.add("padding" if slot < 0 else "keep" if keep else
                      "chunked" if hi - lo >= CHUNKED_FROM else "last")
            if slot >= 0:
                kinds.add("from zero" if src < 0 else "from row")
            if keep and 0 <= src < hi - lo:
                kinds.add("src rewritten")
    assert kinds == {"padding", "keep", "chunked", "last", "from zero", "from row",
                     "src rewritten"}


def test_kernels_refuse_cpu_tensors_outside_the_interpreter() -> None:
    layer, x, rows, pools = _case(SHAPES[0], 0)
    with pytest.raises(RuntimeError, match="gated_delta"):
        gated_delta.conv1d_rows(x, layer.conv1d.weight[:, 0], pools[0], rows)


def test_state_rows_carry_keep_flags_on_the_device_side() -> None:
    rows = StateRows.build([(0, -1, False), (3, 2, True), (-1, -1, True)],
                           [(0, 5), (5, 9), (9, 10)])
    assert rows.keep_flags.tolist() == [0, 1, 1]
    assert rows.seq_starts.tolist() == [0, 5, 9, 10]

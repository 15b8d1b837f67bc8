"""A TP group's step messages packed into bytes (engine/tp_packing.py): every field kind
round-trips exactly (tensors by dtype, shape and value; an AttnBatch with windowed groups
and recurrent state rows; ints, floats, None), step messages never touch pickle, and a
verify step's inputs fit in one broadcast slab."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from chainspec.engine.tp_channel import SLAB
from chainspec.engine.tp_packing import PICKLED, pack, unpack
from chainspec.models.attention import AttnBatch, SeqRows


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.shape == b.shape and torch.equal(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def _batch(with_states: bool) -> AttnBatch:
    seqs = [SeqRows([3, 1, 4], 5, 4, window_tables={8: [0, 2, 6]}, state_slot=2, state_src=1,
                    keep_rows=True),
            SeqRows([9], 0, 3, window_tables={8: [5]}, state_slot=0)]
    return AttnBatch.build(seqs, 4, windows=(8,), with_states=with_states)


@pytest.fixture
def no_pickle(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a step message was pickled")
    monkeypatch.setattr(pickle, "dumps", refuse)


@pytest.mark.parametrize("with_states", [False, True])
def test_a_paged_step_round_trips_without_pickle(with_states, no_pickle) -> None:
    ids = torch.tensor([5, 9, 13, 2, 7, 30, 11])
    msg = ("paged", ids, _batch(with_states), 0.125)
    got = unpack(pack(msg))
    assert same(got, msg)
    assert got[2].states is None if not with_states else got[2].states.keep == (True, False)


def test_every_field_kind_round_trips(no_pickle) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, generator=g)
    msg = ("draft_step", 2, torch.tensor([1, 2, 3]), hidden.to(torch.bfloat16),
           hidden[:, 1:4],  # not contiguous
           torch.tensor(7), torch.tensor([True, False]), torch.zeros(0, 4, dtype=torch.int32),
           None, -3, True, 1e-300, (4, -1, 0))
    got = unpack(pack(msg))
    assert same(got, (*msg[:4], hidden[:, 1:4].contiguous(), *msg[5:]))
    assert unpack(pack(("stop",))) == ("stop",)


def test_other_messages_are_pickled_whole() -> None:
    msg = ("cache", {"num_blocks": {None: 5}, "dtype": torch.bfloat16}, 3)
    data = pack(msg)
    assert int(data[8:16].view(torch.int64)) == PICKLED
    assert unpack(data) == msg


def test_a_verify_step_fits_one_slab(no_pickle) -> None:
    """16 sequences of K+1 = 4 rows at position 2,000 (block 16: 126 blocks each)."""
    seqs = [SeqRows(list(range(i * 126, (i + 1) * 126)), 2000, 4) for i in range(16)]
    msg = ("paged", torch.arange(64), AttnBatch.build(seqs, 16), 0.1)
    assert pack(msg).numel() <= SLAB - 8

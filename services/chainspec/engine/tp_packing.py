"""A tensor-parallel group's command messages as one flat byte tensor (no pickle on the
step path; `engine/tp_channel.Channel` sends it).

A message is a tuple: a kind (a str of `KINDS`) and fields, each None, a bool, an int, a
float, a tensor, an int tuple or an `AttnBatch`. Its packed form is

    [header length n: int64][header: n int64][payload: each tensor's bytes, 8-aligned]

where the header holds the kind's code and each field as a tag and its values (a
tensor: dtype code, rank, dims). A message with anything else (the cache geometry, a
dict) is pickled whole under the code `PICKLED`: those are once per group, not per step.
Decoded tensors are views of the received buffer, which is never reused.
"""

from __future__ import annotations

import pickle
import struct

import torch

from chainspec.models.attention import AttnBatch, PagedGroup
from chainspec.models.recurrent import StateRows

KINDS = ("stop", "ping", "paged", "dense", "logits", "draft_step", "draft_logits",
         "fingerprint", "cache", "graphs", "replay")
PICKLED = -1
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64)
NONE, INT, FLOAT, TENSOR, INTS, BATCH, BOOL = range(7)
ALIGN = 8


def pack(msg: tuple) -> torch.Tensor:
    """msg -> [bytes] uint8."""
    writer = _Writer()
    try:
        writer.head.append(KINDS.index(msg[0]))
        for field in msg[1:]:
            writer.value(field)
    except (TypeError, ValueError):  # not a step message's fields: pickled whole
        writer = _Writer()
        writer.head.append(PICKLED)
        writer.tensors.append(torch.frombuffer(bytearray(pickle.dumps(msg)),
                                               dtype=torch.uint8))
    return writer.bytes()


def unpack(data: torch.Tensor) -> tuple:
    """The inverse of `pack` ([bytes] uint8 -> msg)."""
    n = int(data[:8].view(torch.int64))
    head = data[8:8 + 8 * n].view(torch.int64).tolist()
    reader = _Reader(head, data, 8 + 8 * n)
    kind = reader.next()
    if kind == PICKLED:
        return pickle.loads(data[reader.offset:].numpy().tobytes())
    fields = []
    while reader.i < len(head):
        fields.append(reader.value())
    return (KINDS[kind], *fields)


class _Writer:
    def __init__(self) -> None:
        self.head: list[int] = []
        self.tensors: list[torch.Tensor] = []

    def value(self, v) -> None:
        if v is None:
            self.head.append(NONE)
        elif isinstance(v, bool):
            self.head += [BOOL, int(v)]
        elif isinstance(v, int):
            self.head += [INT, v]
        elif isinstance(v, float):
            self.head += [FLOAT, struct.unpack("<q", struct.pack("<d", v))[0]]
        elif isinstance(v, torch.Tensor):
            self.head += [TENSOR, DTYPES.index(v.dtype), v.dim(), *v.shape]
            self.tensors.append(v.detach().reshape(-1).to("cpu").view(torch.uint8))
        elif isinstance(v, tuple) and all(isinstance(x, bool | int) for x in v):
            self.head += [INTS, len(v), *map(int, v)]
        elif isinstance(v, AttnBatch):
            self.head.append(BATCH)
            self.batch(v)
        else:
            raise TypeError(f"no packed form for {type(v).__name__}")

    def batch(self, b: AttnBatch) -> None:
        for t in (b.positions, b.slot_mapping, b.row_seq, b.block_tables):
            self.value(t)
        self.value(tuple(b.windows))
        for g in b.windows.values():
            self.value(g.slot_mapping)
            self.value(g.block_tables)
        s = b.states
        self.value(None if s is None else tuple(i for span in s.spans for i in span))
        if s is not None:
            for v in (s.slots, s.src, s.keep, s.seq_starts, s.slot_ids, s.src_rows,
                      s.keep_flags):
                self.value(v)

    def bytes(self) -> torch.Tensor:
        head = torch.tensor([len(self.head), *self.head], dtype=torch.int64)
        parts = [head.view(torch.uint8)]
        for t in self.tensors:
            parts.append(t)
            if t.numel() % ALIGN:
                parts.append(torch.zeros(ALIGN - t.numel() % ALIGN, dtype=torch.uint8))
        return torch.cat(parts)


class _Reader:
    def __init__(self, head: list[int], data: torch.Tensor, offset: int) -> None:
        self.head, self.data, self.offset, self.i = head, data, offset, 0

    def next(self) -> int:
        self.i += 1
        return self.head[self.i - 1]

    def value(self):
        tag = self.next()
        if tag == NONE:
            return None
        if tag == INT:
            return self.next()
        if tag == BOOL:
            return bool(self.next())
        if tag == FLOAT:
            return struct.unpack("<d", struct.pack("<q", self.next()))[0]
        if tag == TENSOR:
            return self.tensor()
        if tag == INTS:
            return tuple(self.next() for _ in range(self.next()))
        if tag == BATCH:
            return self.batch()
        raise ValueError(f"bad packed message (tag {tag})")

    def tensor(self) -> torch.Tensor:
        dtype = DTYPES[self.next()]
        shape = [self.next() for _ in range(self.next())]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = self.data[self.offset:self.offset + nbytes]
        self.offset += -(-nbytes // ALIGN) * ALIGN
        return raw.view(dtype).view(shape)

    def batch(self) -> AttnBatch:
        positions, slots, row_seq, tables = (self.value() for _ in range(4))
        windows = {w: PagedGroup(self.value(), self.value()) for w in self.value()}
        spans = self.value()
        states = None
        if spans is not None:
            pairs = tuple(zip(spans[::2], spans[1::2], strict=True))
            fields = [self.value() for _ in range(7)]
            states = StateRows(pairs, fields[0], fields[1], tuple(map(bool, fields[2])),
                               *fields[3:])
        return AttnBatch(positions, slots, row_seq, tables, windows, states)


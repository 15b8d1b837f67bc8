"""Tiny family pairs (target + native MTP drafter) and a `VerifyGraphs` that checks every
step it runs against the packed path on the same cache. Shared by the CPU tests
(tests/unit/families/test_family_verify_graphs.py) and `make gpu-check`
(benchmarks/gpu/family_graphs.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.schedule import Work
from chainspec.engine.verify_batch import _packed_forward
from chainspec.engine.verify_graphs import VerifyGraphs

FAMILIES = ("qwen3_5", "mimo_v2_flash", "deepseek_v3", "step3", "qwen3_next")
VOCAB = 24  # small: random drafters' drafts sometimes hit
BLOCKS = KVBudget(block_size=4)
CHUNK = 5


def write_family(name: str, path: Path) -> None:
    """A tiny random checkpoint of family `name` with its MTP layers in native layout
    (MiMo-V2-Flash, Step-3.5-Flash: window 8 over blocks of 4; Qwen3.5: three GDN
    layers, one full)."""
    if name == "qwen3_5":
        from tests.unit.families.qwen3_5_checkpoint import write_checkpoint
        write_checkpoint(path, seed=5, vocab_size=VOCAB)
    elif name == "mimo_v2_flash":
        from tests.unit.families.mimo_v2_flash_checkpoint import write_checkpoint
        write_checkpoint(path, seed=5, vocab_size=VOCAB)
    elif name == "deepseek_v3":
        from tests.unit.families.deepseek_v3_checkpoint import write_with_mtp
        write_with_mtp(path, agreeing=True, vocab_size=VOCAB)
    elif name == "qwen3_next":  # fused GDN projections, MoE layers and MTP layer
        from tests.unit.families.qwen3_next_checkpoint import write_checkpoint
        write_checkpoint("qwen3_next", path, seed=5, vocab_size=VOCAB)
    elif name == "step3":  # seed 0: some of its random drafts are accepted here
        from tests.unit.families.step3_checkpoint import write_checkpoint
        write_checkpoint(path, seed=0, vocab_size=VOCAB)
    else:
        raise ValueError(f"no tiny checkpoint for family {name!r}")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Across chunks of 5 and blocks of 4; with 14 new tokens, past a window of 8."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [9, 17, 12, 4, 21, 6, 3, 8][:n]
    return [torch.randint(0, VOCAB, (m,), generator=gen).tolist() for m in lengths]


def _written(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[d0, d1] bool: which (block, offset) or (slot, kept row) entries changed."""
    return (old != new).flatten(2).any(-1)


class CheckedGraphs(VerifyGraphs):
    """Runs each step on the static buffers (replayed or eager), then again on the packed
    path from the same cache, and records how far they differ: hidden rows, cache values,
    and whether they wrote the very same entries (padding writes nothing). The cache
    keeps the packed path's writes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checked = self.padded = self.ragged = self.trimmed = 0
        self.hidden_diff = self.cache_diff = 0.0
        self.same_writes = True

    def run(self, work: Sequence[Work]) -> tuple[torch.Tensor, tuple[int, ...]]:
        tensors = self.cache.tensors()
        before = [t.clone() for t in tensors]
        hidden, offsets = super().run(work)
        hidden = hidden.clone()  # NOTE: a replay's output is overwritten by the next one
        static = [t.clone() for t in tensors]
        for t, b in zip(tensors, before, strict=True):
            t.copy_(b)
        packed, packed_offsets = _packed_forward(self.model, self.cache, work, hidden.device)
        for w, a, b in zip(work, offsets, packed_offsets, strict=True):
            diff = (hidden[a:a + w.num_rows].float() - packed[b:b + w.num_rows].float())
            self.hidden_diff = max(self.hidden_diff, float(diff.abs().max()))
        for old, mine, ref in zip(before, static, tensors, strict=True):
            self.same_writes &= torch.equal(_written(old, mine), _written(old, ref))
            self.cache_diff = max(self.cache_diff, float((mine.float() - ref.float()).abs().max()))
        self.checked += 1
        self.padded += len(work) < self.dispatch(len(work)).batch_size
        self.ragged += any(w.num_rows < self.rows_per_seq for w in work)
        self.trimmed += any(None in t.blocks for w in work
                            for t in w.request.claims.windows.values())
        return hidden, offsets

    def summary(self) -> dict:
        return {"checked_steps": self.checked, "padded_steps": self.padded,
                "ragged_steps": self.ragged, "trimmed_window_steps": self.trimmed,
                "replays": self.replays, "eager_runs": self.eager_runs,
                "hidden_max_diff": self.hidden_diff, "cache_max_diff": self.cache_diff,
                "same_writes": self.same_writes}


def checked(eng, use_graphs: bool = False) -> CheckedGraphs:
    """Give engine `eng` checked verify graphs (captured where CUDA and the model allow;
    else the static path, eagerly)."""
    c = eng.config
    eng.graphs = CheckedGraphs(eng.model, eng.cache, c.max_seqs, c.num_steps, c.max_len,
                               use_graphs=use_graphs, static_on_cpu=True)
    eng.graphs.capture()
    return eng.graphs

"""GPU-only: the verifier's decode/verify steps replay CUDA graphs per batch bucket, and
outputs equal an engine without graphs (and plain decoding), under preemption too.
Skipped without a GPU (the same static buffers run eagerly on CPU in
tests/unit/test_verify_graphs.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from chainspec.engine.kv_budget import KVBudget
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none visible to torch)")
CUDA = torch.device("cuda")


def _models():
    target, draft = tied_pair()
    return target.to(CUDA), draft.to(CUDA)


def _without_graphs(eng):
    eng.config = dataclasses.replace(eng.config, use_graphs=False)
    eng.graphs.enabled = False
    return eng


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_replayed_steps_equal_eager_steps(batch: int) -> None:
    target, draft = _models()
    ps = prompts(batch)
    eager = outputs(_without_graphs(engine(target, draft, max_seqs=8)), ps, max_tokens=30)[0]
    eng = engine(target, draft, max_seqs=8)
    assert len(eng.graphs.graphs) == len(eng.graphs.buckets)  # every bucket captured
    got = outputs(eng, ps, max_tokens=30)[0]
    assert got == eager
    assert eng.graphs.replays > 0


def test_plain_decode_replays_and_equals_plain_under_preemption() -> None:
    target, _ = _models()
    ps = prompts(8)
    roomy = outputs(_without_graphs(engine(target)), ps, max_tokens=30)[0]
    eng = engine(target, kv=KVBudget(block_size=4, blocks=20))
    assert outputs(eng, ps, max_tokens=30)[0] == roomy
    assert eng.preemptions > 0 and eng.graphs.replays > 0

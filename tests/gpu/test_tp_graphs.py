"""GPU-only: a TP leader on NCCL captures its shard's forward, all-reduces included, in
the verifier's CUDA graphs, and the step inputs travel outside them (engine/tp_group.py
GraphPeers). One rank (NCCL over one GPU: the capture of the collectives themselves) and,
with two GPUs, two ranks: every bucket captured, steps replayed, greedy output equal to
TP=1. Skipped without a GPU, the two-rank case with fewer than two (the protocol runs
eagerly on CPU in tests/unit/test_tp_verify_graphs.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from chainspec.engine.factory import build_verifier_engine, load_models
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.tp_launch import start_local_group

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none visible to torch)")
PROMPTS = [[5, 9, 13, 2, 7, 30, 11], [3] * 21, [17, 4, 60, 8, 1, 12, 6, 45, 33, 2, 9]]


def _generate(engine) -> list[list[int]]:
    stop = StopConditions(max_tokens=24, ignore_eos=True)
    result = run_to_completion(engine, PROMPTS, SamplingParams(temperature=0.0), stop)
    return [c.tokens for c in result.completions]


@pytest.mark.parametrize("world", [1, 2])
def test_nccl_group_replays_captured_steps_equal_to_tp1(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    opts = LocalOptions(model_dir=DEMO_MODEL, device="cuda", dtype="float32", num_steps=3,
                        max_seqs=4, max_len=128)
    eager = dataclasses.replace(opts, use_graphs=False)
    plain = _generate(build_verifier(load_models(eager, speculative=False), eager,
                                     speculative=False))
    group = start_local_group(DEMO_MODEL, world, device="cuda", cache_len=opts.max_len)
    try:
        assert group.leader.graph_safe  # NCCL
        engine = build_verifier_engine(group.leader, opts, None)
        graphs = engine.graphs
        assert graphs.use_graphs and len(graphs.graphs) == len(graphs.buckets)
        assert _generate(engine) == plain
        assert graphs.replays > 0
    finally:
        group.close()

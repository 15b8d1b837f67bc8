"""CUDA graphs and a TP group's collectives (issue 22, DESIGN 4.10). The rule: a TP
leader is graph safe only when its group's backend is NCCL (whose collectives a CUDA graph
can record) and its shard's layers are; gloo stays eager. The protocol, run eagerly on CPU
(gloo) as the verifier's static-buffer tests do: rank 0 fills its static buffers, sends
the bucket's view to rank 1 (outside any graph), rank 1 copies it into its own buffers
and runs the same bucket; greedy and speculative output equal TP=1 token for token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from chainspec.engine.factory import LoadedModels, build_verifier_engine, load_models
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.tp_group import TPLeader
from chainspec.engine.tp_launch import start_local_group
from chainspec.engine.verify_graphs import VerifyGraphs
from chainspec.models.tensor_parallel import TPGroup

PROMPTS = [[5, 9, 13, 2, 7, 30, 11], [3] * 21, [17, 4, 60, 8, 1, 12, 6, 45, 33, 2, 9]]


class _Shard(nn.Module):
    def __init__(self, backend: str, layers_safe: bool) -> None:
        super().__init__()
        self.tp = TPGroup(0, 2, backend=backend)
        self.config = self.family = None
        self.graph_safe = layers_safe


@pytest.mark.parametrize("backend, layers_safe, safe", [
    ("nccl", True, True), ("gloo", True, False), ("nccl", False, False)])
def test_a_tp_leader_is_graph_safe_on_nccl_only(backend, layers_safe, safe) -> None:
    assert TPLeader(_Shard(backend, layers_safe), channel=None).graph_safe is safe


@pytest.fixture(scope="module")
def setup():
    opts = LocalOptions(model_dir=DEMO_MODEL, num_steps=3, max_seqs=4, max_len=128,
                        kv_block_size=4, use_graphs=False)
    group = start_local_group(DEMO_MODEL, 2, cache_len=opts.max_len)
    try:
        yield opts, load_models(opts, speculative=True), group.leader
    finally:
        group.close()


def _on_static_buffers(engine, opts) -> VerifyGraphs:
    engine.graphs = VerifyGraphs(engine.model, engine.cache, opts.max_seqs, engine.config.num_steps,
                                 opts.max_len, use_graphs=False, static_on_cpu=True)
    engine.graphs.capture()  # the peers build their buffers (no graph on CPU)
    return engine.graphs


def _generate(engine) -> list[list[int]]:
    stop = StopConditions(max_tokens=16, ignore_eos=True)
    result = run_to_completion(engine, PROMPTS, SamplingParams(temperature=0.0), stop)
    return [c.tokens for c in result.completions]


def test_static_steps_of_a_tp_group_equal_tp1(setup) -> None:
    opts, reference, leader = setup
    assert not leader.graph_safe  # gloo: eager, whatever the device
    plain = _generate(build_verifier(reference, opts, speculative=False))
    engine = build_verifier_engine(leader, opts, None)
    graphs = _on_static_buffers(engine, opts)
    assert graphs.peers is not None and graphs.compute is leader.shard
    assert _generate(engine) == plain
    assert graphs.eager_runs > 0 and graphs.replays == 0  # decode steps took the bucket path
    spec_opts = dataclasses.replace(opts, num_steps=3)
    spec = build_verifier(LoadedModels(leader, reference.draft), spec_opts, speculative=True)
    spec_graphs = _on_static_buffers(spec, spec_opts)
    assert _generate(spec) == plain
    assert spec_graphs.eager_runs > 0


def test_static_buffers_refill_from_another_ranks_view(setup) -> None:
    """`fill` copies a leader's bucket view so that the follower's view is the same."""
    opts, reference, _ = setup
    engine = build_verifier_engine(reference.target, opts, None)
    ours = _on_static_buffers(engine, opts).buffers
    theirs = VerifyGraphs(reference.target, engine.cache, opts.max_seqs, 3, opts.max_len,
                          use_graphs=False, static_on_cpu=True).buffers
    g = torch.Generator().manual_seed(0)
    for buf in (ours.ids, ours.positions, ours.row_seq, ours.slot_mapping, ours.block_tables):
        buf.copy_(torch.randint(0, 50, buf.shape, generator=g))
    ids, batch = ours.view(2)
    theirs.fill(ids, batch, 2)
    got_ids, got = theirs.view(2)
    assert torch.equal(got_ids, ids)
    for name in ("positions", "slot_mapping", "row_seq", "block_tables"):
        assert torch.equal(getattr(got, name), getattr(batch, name)), name

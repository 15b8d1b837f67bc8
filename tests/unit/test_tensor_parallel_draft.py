"""A tensor-parallel MTP drafter (DESIGN 4.10, issue 22 item 3): the drafter's modules
split over a TP=2 group (gloo), rank 0's `DrafterEngine` over a `DraftLeader`, rank 1
following each draft step. With a TP=1 target, speculative output equals plain and the
verifier accepts exactly as many drafts as with the TP=1 drafter (the same drafts, round
by round); each rank holds half of the drafter's sharded parameters. The demo (Llama
MTP block, 3 modules) and a tiny DeepSeek-V3 (an MLA MTP block)."""

from __future__ import annotations

import dataclasses

import pytest

from chainspec.engine.factory import build_verifier_engine, load_models
from chainspec.engine.local import DEMO_MODEL, LocalOptions, local_drafter
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.tp_launch import start_local_group
from chainspec.models.tensor_parallel import sharded_numel
from tests.unit.families.deepseek_v3_checkpoint import write_with_mtp

PROMPTS = [[5, 9, 13, 2, 7, 30, 11], [3] * 21, [17, 4, 60, 8, 1, 12, 6, 45, 33, 2, 9]]


def _deepseek(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tp_draft_mla")
    write_with_mtp(model_dir, agreeing=True)
    return model_dir


CHECKPOINTS = {"demo": lambda _: DEMO_MODEL, "deepseek_mla": _deepseek}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def draft_group(request, tmp_path_factory):
    model_dir = CHECKPOINTS[request.param](tmp_path_factory)
    opts = LocalOptions(model_dir=model_dir, num_steps=3, max_seqs=4, max_len=128,
                        kv_block_size=4, use_graphs=False)
    reference = load_models(opts, speculative=True)
    group = start_local_group(model_dir, 2, cache_len=opts.max_len, draft=True)
    try:
        yield opts, reference, group.leader
    finally:
        group.close()


def _run(target, draft, opts):
    client = None if draft is None else local_drafter(draft, opts)
    engine = build_verifier_engine(target, opts, client)
    stop = StopConditions(max_tokens=20, ignore_eos=True)
    completions = run_to_completion(engine, PROMPTS, SamplingParams(temperature=0.0),
                                    stop).completions
    accepted = merged_stats(completions, opts.num_steps).accepted_tokens
    return [c.tokens for c in completions], accepted


@pytest.mark.parametrize("k", [1, 3])
def test_tp2_drafter_drafts_as_tp1(draft_group, k):
    opts, reference, leader = draft_group
    opts = dataclasses.replace(opts, num_steps=k)
    plain, _ = _run(reference.target, None, opts)
    tokens1, accepted1 = _run(reference.target, reference.draft, opts)
    tokens2, accepted2 = _run(reference.target, leader, opts)
    assert tokens2 == tokens1 == plain
    assert accepted2 == accepted1 > 0


def test_each_drafter_rank_holds_half_of_the_sharded_parameters(draft_group):
    _, reference, leader = draft_group
    local, full = sharded_numel(leader.shard, leader.shard.tp_shards)
    assert 2 * local == full
    assert sum(p.numel() for p in leader.shard.parameters()) < 0.6 * sum(
        p.numel() for p in reference.draft.parameters())

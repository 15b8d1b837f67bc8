"""The Ray hosting of a TP=2 group (DESIGN 4.10): rank 1 a Ray actor in bundle 1 of a
STRICT_PACK placement group, rank 0 this driver. Greedy output through the engine equals
TP=1's token for token; closing the group stops the rank (it reports the forwards it
followed) and gives the placement group back."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group_table

from chainspec.cluster.tp_ranks import start_ray_group
from chainspec.engine.factory import build_verifier_engine, load_target_model
from chainspec.engine.local import DEMO_MODEL, LocalOptions
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams

PROMPTS = [[5, 9, 13, 2, 7, 30, 11], [3] * 21]


def _generate(target, opts):
    engine = build_verifier_engine(target, opts, None)
    stop = StopConditions(max_tokens=16, ignore_eos=True)
    result = run_to_completion(engine, PROMPTS, SamplingParams(temperature=0.0), stop)
    return [c.tokens for c in result.completions]


def test_ray_tp_group_equals_tp1(ray_cluster):
    opts = LocalOptions(model_dir=DEMO_MODEL, max_seqs=2, max_len=64, kv_block_size=4,
                        use_graphs=False)
    plain = _generate(load_target_model(opts), opts)
    group = start_ray_group(DEMO_MODEL, 2, cache_len=opts.max_len)
    pg_id = group.pg.id.hex()
    try:
        assert _generate(group.leader, opts) == plain
    finally:
        counts = group.close()
    assert counts[0] > 0  # rank 1 ran the forwards in lockstep
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
    assert ray.is_initialized()

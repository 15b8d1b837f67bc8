"""The Ray actors' own engine-building code, run without Ray: a stack config's engine
options (draft top-k, CUDA graphs off, KV block size, drafter slots) reach the drafter
actor's engine, and the verifier actor's engine and its in-process drafter, all built by
engine/factory.py; with them, a sampled request is drafted every round and greedy output
equals plain decoding."""

from __future__ import annotations

import pytest

from chainspec.cluster.actors import DrafterActor, VerifierActor
from chainspec.cluster.config import DrafterRoleConfig, RoleConfig, StackConfig
from chainspec.engine.factory import TimedDrafterEngine, drafter_config, verifier_config
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.integration.helpers import generate, plain_outputs, prompt_ids, verifier_stub

pytestmark = pytest.mark.timeout(120)
OPTIONS = {"draft_top_k": 4, "use_graphs": False, "kv_block_size": 8, "max_len": 256,
           "num_steps": 3}


def actor(cls, config: StackConfig):
    """The actor class's methods on a plain instance (no Ray, no start task)."""
    self = cls.__new__(cls)
    self.member_id, self.config, self.server, self.error = f"{cls.role}-test", config, None, None
    return self


def test_the_drafter_actor_builds_from_the_stack_options(model_dir) -> None:
    config = StackConfig(model_dir=str(model_dir), drafter_max_seqs=5, **OPTIONS)
    engine = actor(DrafterActor, config)._build_engine(None)
    assert isinstance(engine, TimedDrafterEngine)  # its stats() reads the counters
    assert engine.config == drafter_config(config.local_options("drafter"))
    c = engine.config
    assert (c.top_k, c.use_graphs, c.max_seqs, c.kv.block_size) == (4, False, 5, 8)


def test_the_verifier_actor_serves_with_the_stack_options(model_dir, loop_thread) -> None:
    config = StackConfig(model_dir=str(model_dir), max_seqs=4,
                         drafter=DrafterRoleConfig(mode="local"),
                         verifier=RoleConfig(metrics_port=None), **OPTIONS)
    server = loop_thread.run(actor(VerifierActor, config).serve())
    try:
        core = server.engine.engine
        assert core.config == verifier_config(config.local_options("verifier"))
        assert (core.config.draft_top_k, core.config.use_graphs) == (4, False)
        drafter = server.drafts.engine  # in process: drafter mode local
        assert isinstance(drafter, TimedDrafterEngine)
        assert (drafter.config.top_k, drafter.config.use_graphs, drafter.config.max_seqs,
                drafter.config.kv.block_size) == (4, False, 4, 8)
        channel, stub = verifier_stub(server.address)
        prompts = prompt_ids(model_dir, 2)
        sampled = generate(stub, prompts[0], 16,
                           sampling=pb.SamplingParams(temperature=0.8, seed=7))
        greedy = generate(stub, prompts[1], 16)
        channel.close()
        assert sampled.finished.stats.draft_tokens > 0
        assert sampled.finished.stats.fallback_rounds == 0  # every round had its drafts
        assert greedy.tokens == plain_outputs(model_dir, prompts[1:], 16)[0]
        assert drafter.updates > 0
    finally:
        loop_thread.run(server.stop())

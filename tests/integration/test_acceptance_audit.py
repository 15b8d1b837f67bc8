"""DESIGN 3.5 on the demo model: the engine's per-position acceptance equals the offline
simulation within 0.02 in every mode (eager, static buffers, the local drafter as
`chainspec generate` builds it, a remote drafter over gRPC), and the check fails when
one chain step is fed the wrong hidden state."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.factory import build_drafter
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.verify_graphs import VerifyGraphs
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.draft_pool import DrafterMatch, GrpcDraftClient
from chainspec.training.evaluate import simulate_rounds
from tests.acceptance_audit import (
    TOLERANCE,
    assert_acceptance_matches,
    engine_acceptance,
    rate_gaps,
)
from tests.integration.grpc_helpers import start_drafter

pytestmark = pytest.mark.timeout(300)
K, MAX_NEW, PROMPTS = 3, 32, 12


@pytest.fixture(scope="module")
def demo():
    opts = LocalOptions(DEMO_MODEL, num_steps=K, max_seqs=4, max_len=512)
    models = load_models(opts, speculative=True)
    tok = Tokenizer.from_dir(DEMO_MODEL)
    texts = json.loads((DEMO_MODEL / "heldout_prompts.json").read_text())
    prompts = [tok.encode(t)[:48] for t in texts[:PROMPTS]]
    return opts, models, prompts


@pytest.fixture(scope="module")
def offline(demo):
    opts, models, prompts = demo
    return simulate_rounds(models.target, models.draft, prompts, K, MAX_NEW)


def _local(models, opts, eager_drafter: bool = False):
    drafter = build_drafter(copy.deepcopy(models.draft), opts.for_drafter())
    if eager_drafter:
        drafter.runner.fits = lambda windows: False  # every round on the packed path
    return LocalDraftClient(drafter)


def _verifier(models, opts, client, static: bool = False):
    eng = build_verifier(dataclasses.replace(models, draft=None), opts, speculative=False)
    eng.drafter = client
    if static:  # decode/verify steps on the static buffers the CUDA graphs replay
        eng.graphs = VerifyGraphs(eng.model, eng.cache, opts.max_seqs, K, opts.max_len,
                                  use_graphs=False, static_on_cpu=True)
    return eng


@pytest.mark.parametrize("mode", ["eager", "static", "local"])
def test_in_process_modes_match_the_offline_simulation(demo, offline, mode):
    opts, models, prompts = demo
    if mode == "local":
        eng = build_verifier(models, opts, speculative=True)  # as `chainspec generate`
    else:
        eng = _verifier(models, opts, _local(models, opts, eager_drafter=mode == "eager"),
                        static=mode == "static")
    got = engine_acceptance(eng, prompts, MAX_NEW)
    assert offline.mean_length > 1.5, "drafts are really at stake"
    assert_acceptance_matches(got, offline)


def test_remote_drafter_matches_the_offline_simulation(demo, offline, loop):
    opts, models, prompts = demo
    drafter = build_drafter(copy.deepcopy(models.draft), opts.for_drafter())
    server = start_drafter(loop, drafter)
    client = GrpcDraftClient([server.address], round_deadline_s=10.0,
                             match=DrafterMatch(K, models.target.config.hidden_size,
                                                models.target.config.vocab_size))
    try:
        got = engine_acceptance(_verifier(models, opts, client), prompts, MAX_NEW)
    finally:
        client.close()
        loop.run(server.stop(0))
    assert_acceptance_matches(got, offline)


def test_a_chain_step_fed_the_wrong_hidden_state_fails_the_check(demo, offline):
    """The seed's bug class: step 2 reads h instead of g[1]. Outputs stay right (the
    verifier decides every token); only acceptance moves, and the check sees it."""
    opts, models, prompts = demo
    client = _local(models, opts)
    draft = client.engine.model
    step = draft.step
    seen = {}

    def wrong_step(k, tokens, prev, positions, backend):
        if k == 1:
            seen["h"] = prev
        return step(k, tokens, seen["h"] if k == 2 else prev, positions, backend)

    draft.step = wrong_step
    got = engine_acceptance(_verifier(models, opts, client), prompts, MAX_NEW)
    assert max(rate_gaps(got, offline)) > TOLERANCE
    with pytest.raises(AssertionError, match="per-position acceptance"):
        assert_acceptance_matches(got, offline)

"""Paged KV under pressure: with a block pool too small for the load, the verifier preempts
(recompute) and every request still gets exactly the tokens it gets with room to spare;
a drafter out of blocks refuses sequences, and the verifier stays lossless."""

from __future__ import annotations

import pytest
import torch

from chainspec.engine.draft_types import DraftResult, ErrorCode, SeqFailure, SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.metrics.verifier import VerifierMetrics
from tests.unit.draft_reference import reference_drafts
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair

TIGHT = KVBudget(block_size=4, blocks=20)  # 8 sequences of up to ~58 positions need ~100


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


@pytest.fixture(scope="module")
def plain(pair):
    return outputs(engine(pair[0]), prompts(8), max_tokens=30)[0]


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_outputs_equal_plain_when_the_pool_is_too_small(pair, plain, speculative):
    target, draft = pair
    eng = engine(target, draft if speculative else None, kv=TIGHT)
    got, _ = outputs(eng, prompts(8), max_tokens=30)
    assert got == plain
    assert eng.preemptions > 0  # the pool really was too small
    assert eng.allocator.num_used == 0  # every block came back


def test_draft_ahead_stays_lossless_under_preemption(pair, plain):
    target, draft = pair
    eng = engine(target, draft, kv=TIGHT, draft_ahead=True)
    got, _ = outputs(eng, prompts(8), max_tokens=30)
    assert got == plain and eng.preemptions > 0
    assert eng.ahead_hits + eng.ahead_misses > 0  # look-aheads were judged


def test_sampled_outputs_survive_preemption(pair):
    target, draft = pair
    roomy, _ = outputs(engine(target, draft), prompts(8), 30, temperature=0.8)
    eng = engine(target, draft, kv=TIGHT)
    tight, _ = outputs(eng, prompts(8), 30, temperature=0.8)
    assert tight == roomy and eng.preemptions > 0


def test_preemptions_and_block_usage_reach_metrics(pair, plain):
    target, draft = pair
    vm = VerifierMetrics("tiny", 3)
    eng = engine(target, draft, kv=TIGHT)
    eng.observer = vm
    vm.attach(eng, None)
    usage = []
    for i, p in enumerate(prompts(8)):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0),
                        StopConditions(max_tokens=30))
    while eng.has_work:
        eng.step()
        usage.append(vm.registry.get_sample_value("chainspec_kv_cache_usage_perc",
                                                  {"model_name": "tiny"}))
    preempted = vm.registry.get_sample_value("chainspec_num_preemptions_total",
                                             {"model_name": "tiny"})
    assert preempted == eng.preemptions > 0
    assert max(usage) > 0.8 and usage[-1] == 0  # blocks over blocks, all back at the end


def test_a_request_the_whole_pool_cannot_hold_is_refused(pair):
    eng = engine(pair[0], kv=KVBudget(block_size=4, blocks=4))
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        eng.add_request("big", [1] * 10, SamplingParams(), StopConditions(max_tokens=10))


def test_max_seqs_caps_running_sequences_not_memory(pair):
    target, _ = pair
    eng = engine(target, max_seqs=3, kv=KVBudget(block_size=4, blocks=200))
    for i, p in enumerate(prompts(6)):
        eng.add_request(str(i), p, SamplingParams(), StopConditions(max_tokens=5))
    eng.step()
    assert eng.num_running == 3


def test_drafter_out_of_blocks_refuses_and_never_drafts_wrong(pair):
    _, draft = pair
    k = 3
    eng = DrafterEngine(draft, DrafterConfig(num_steps=k, max_seqs=8, max_len=256,
                                             kv=KVBudget(block_size=4, blocks=5)))
    gen = torch.Generator().manual_seed(0)
    seqs = {s: (torch.randint(0, 61, (9,), generator=gen).tolist(),
                torch.randn(8, draft.config.hidden_size, generator=gen)) for s in range(3)}
    out = eng.update([SeqUpdate(s, 0, tuple(t[1:]), h) for s, (t, h) in seqs.items()])
    assert [type(o) for o in out] == [DraftResult, DraftResult, SeqFailure]
    assert out[2].code == ErrorCode.RESOURCE_EXHAUSTED and 2 not in eng.seqs
    for s in (0, 1):
        tokens, hidden = seqs[s]
        want, _ = reference_drafts(draft, tokens, hidden, k, True)
        assert out[s].tokens.tolist() == want
    # sequence 0 grows past its blocks: refused, and its blocks go back to the pool
    more = eng.update([SeqUpdate(0, 8, tuple(range(1, 13)), torch.randn(12, 32))])
    assert more[0].code == ErrorCode.RESOURCE_EXHAUSTED and 0 not in eng.seqs
    assert eng.allocator.num_used == 2


def test_verifier_stays_lossless_when_its_drafter_runs_out_of_blocks(pair, plain):
    target, draft = pair
    eng = engine(target, draft, drafter_kv=KVBudget(block_size=4, blocks=24))
    result = run_to_completion(eng, prompts(8), SamplingParams(temperature=0.0),
                               StopConditions(max_tokens=30))
    assert [c.tokens for c in result.completions] == plain
    stats = [c.stats for c in result.completions]
    assert sum(s.fallback_rounds for s in stats) > 0  # some rounds went plain
    assert sum(s.accepted_tokens for s in stats) > 0  # others still speculated

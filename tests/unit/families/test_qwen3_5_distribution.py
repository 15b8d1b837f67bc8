"""Losslessness under sampling on a hybrid family: with a tiny Qwen3.5 target (Gated
DeltaNet + gated attention) and its MTP drafter, the joint distribution of generated
tokens 4 and 5 -- decided after verify rounds with partly accepted drafts, so from GDN
states kept at row j -- is the same with and without speculation (seeded and unseeded
requests, top-k sampled drafts). A verifier that continues from the wrong kept state
is caught by the same comparison."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from chainspec.engine import verify_batch
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.adapters import QWEN3_5
from chainspec.models.config import ModelConfig
from chainspec.models.families.qwen3_5 import mtp_block
from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel
from tests.unit.engine_fixtures import engine
from tests.unit.families.qwen3_5_checkpoint import hf_config
from tests.unit.stats import chi_square_two_sample

VOCAB, REQUESTS, BATCH, FIRST = 4, 1500, 100, 3
PROMPT = [1, 3, 0, 2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair():
    raw = hf_config(vocab_size=VOCAB, mtp_num_hidden_layers=1).to_dict()
    cfg = ModelConfig.from_hf({**raw, "architectures": ["Qwen3_5ForCausalLM"]})
    torch.manual_seed(7)
    target = TargetModel(cfg).eval()
    draft = MTPDraftModel(cfg, 1, QWEN3_5.glue, block=mtp_block).eval()
    with torch.no_grad():
        for model in (target, draft):
            for name, p in model.named_parameters():
                p.normal_(0.0, 0.3 if p.dim() > 1 else 0.1)
                if name.endswith("linear_attn.norm.weight"):
                    p.add_(1.0)
        target.lm_head.weight.mul_(0.8)  # p and q overlap but differ
    draft.embed_tokens.weight = target.model.embed_tokens.weight
    draft.lm_head.weight = target.lm_head.weight
    return target, draft


def later_pair(eng, seed_base: int, seeded: bool = True) -> collections.Counter:
    """Counts of generated tokens (x_FIRST, x_FIRST+1)."""
    counts: collections.Counter = collections.Counter()
    stop = StopConditions(max_tokens=FIRST + 2)
    eng.drafted = eng.accepted = 0
    for b in range(0, REQUESTS, BATCH):
        params = [SamplingParams(temperature=1.0, seed=seed_base + b + i if seeded else None)
                  for i in range(BATCH)]
        result = run_to_completion(eng, [PROMPT] * BATCH, params, stop)
        counts.update(tuple(c.tokens[FIRST:FIRST + 2]) for c in result.completions)
        eng.drafted += sum(c.stats.draft_tokens for c in result.completions)
        eng.accepted += sum(c.stats.accepted_tokens for c in result.completions)
    return counts


def cells(counts: collections.Counter) -> list[int]:
    return [counts[(a, b)] for a in range(VOCAB) for b in range(VOCAB)]


@pytest.fixture(scope="module")
def plain_counts(pair):
    return later_pair(engine(pair[0], max_seqs=BATCH), seed_base=10_000_000)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_speculative_sampling_matches_plain(pair, plain_counts, seeded):
    target, draft = pair
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True)
    spec = later_pair(eng, seed_base=0, seeded=seeded)
    assert 0.2 * eng.drafted < eng.accepted < 0.8 * eng.drafted  # partial windows
    assert chi_square_two_sample(cells(spec), cells(plain_counts)) > 1e-3


def test_a_window_that_keeps_only_its_last_row_is_detected(pair, plain_counts, monkeypatch):
    """The same comparison must reject a verifier whose windows keep the state after
    their last row only, while commits still point at row j."""
    target, draft = pair
    keep_last = verify_batch.seq_rows
    monkeypatch.setattr(verify_batch, "seq_rows",
                        lambda w: dataclasses.replace(keep_last(w), keep_rows=False))
    eng = engine(target, draft, k=2, max_seqs=BATCH, top_k=3, sampled_drafts=True)
    spec = later_pair(eng, seed_base=0)
    assert chi_square_two_sample(cells(spec), cells(plain_counts)) < 1e-6

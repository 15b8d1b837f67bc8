"""GPU-only checks: CUDA-graph capture/replay equals eager, drafts equal the from-scratch
reference on CUDA, and speculative decoding stays lossless on CUDA. Skipped without a GPU
(the same buffer logic runs eagerly on CPU in tests/unit/test_graph_runner.py)."""

from __future__ import annotations

import random

import pytest
import torch

from chainspec.engine.draft_batch import Window
from chainspec.engine.draft_step import draft_round
from chainspec.engine.draft_types import SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.graph_runner import GraphRunner, StaticDraftBuffers, default_buckets
from chainspec.models.kv_cache import ModelKVCache
from tests.unit.draft_reference import reference_drafts
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair
from tests.unit.tiny_models import tiny_draft_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none visible to torch)")
K, HIDDEN, MAX_LEN = 3, 32, 64
BLOCK, NUM_BLOCKS = 4, 8 * 64 // 4
CUDA = torch.device("cuda")


def _windows(n: int, seed: int) -> list[Window]:
    rng = random.Random(seed)
    pool = list(range(NUM_BLOCKS))
    rng.shuffle(pool)  # scattered blocks: sequence s owns pool[16 s : 16 s + 16]
    return [Window(blocks=tuple(pool[16 * s: 16 * s + 16]), first_pos=rng.randint(0, 20),
                   hidden=torch.randn(rows, HIDDEN), tokens=torch.randint(0, 61, (rows,)),
                   temperature=0.7 if s % 2 else 0.0, seed=s)
            for s in range(n) for rows in [rng.randint(1, 2 * K)]]


def _runner(model, cache, use_graphs: bool) -> GraphRunner:
    buffers = StaticDraftBuffers(8, K, HIDDEN, MAX_LEN, BLOCK, CUDA, torch.float32)
    runner = GraphRunner(lambda b, d: draft_round(model, cache, b, d, True, 4), buffers,
                         default_buckets(8), use_graphs)
    runner.capture()
    return runner


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5, 8])
def test_replay_equals_eager(num_seqs: int) -> None:
    model = tiny_draft_model(2).to(CUDA)
    cfg = model.config
    caches = [ModelKVCache.uniform(K, NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                                   device=CUDA) for _ in range(2)]
    graphs, eager = _runner(model, caches[0], True), _runner(model, caches[1], False)
    assert len(graphs.graphs) == len(graphs.buckets)
    for round_seed in range(3):  # several replays of the same graph with new inputs
        wins = _windows(num_seqs, round_seed * 10 + num_seqs)
        a, b = graphs.run(wins), eager.run(wins)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.probs, b.probs)
    assert graphs.replays == 3 and eager.eager_runs == 3
    for x, y in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values,
                    strict=True):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("chain", [True, False])
def test_cuda_drafts_equal_reference(chain: bool) -> None:
    model = tiny_draft_model(2).to(CUDA)
    eng = DrafterEngine(model, DrafterConfig(num_steps=K, chain=chain, max_seqs=4,
                                             max_len=128, max_graph_batch=4))
    rng = random.Random(0)
    tokens = [rng.randrange(61) for _ in range(9)]
    hidden = torch.randn(8, HIDDEN)
    out = eng.update([SeqUpdate(0, 0, tuple(tokens[1:]), hidden)])[0]
    cpu_model = tiny_draft_model(2)
    for _ in range(6):
        expected, _ = reference_drafts(cpu_model, tokens, hidden, K, chain)
        assert out.tokens.tolist() == expected
        n = rng.randint(1, K + 1)
        start = len(tokens) - 1
        new, rows = [rng.randrange(61) for _ in range(n)], torch.randn(n, HIDDEN)
        tokens += new
        hidden = torch.cat([hidden, rows])
        out = eng.update([SeqUpdate(0, start, tuple(new), rows)])[0]
    assert eng.runner.replays > 0


@pytest.mark.parametrize("chain", [True, False])
def test_cuda_rounds_of_mixed_depth_replay_and_equal_reference(chain: bool) -> None:
    """Drafter-side depth on CUDA: graphs captured per depth replay rounds of 1..K steps,
    and every round's drafts equal the reference's first D (lagging steps caught up)."""
    model = tiny_draft_model(2).to(CUDA)
    eng = DrafterEngine(model, DrafterConfig(num_steps=K, chain=chain, max_seqs=4,
                                             max_len=128, max_graph_batch=4))
    assert {key.depth for key in eng.runner.graphs} == set(range(1, K + 1))
    rng = random.Random(1)
    tokens = [rng.randrange(61) for _ in range(9)]
    hidden = torch.randn(8, HIDDEN)
    out = eng.update([SeqUpdate(0, 0, tuple(tokens[1:]), hidden)])[0]
    cpu_model = tiny_draft_model(2)
    replays = eng.runner.replays
    for r in range(12):
        expected, _ = reference_drafts(cpu_model, tokens, hidden, K, chain)
        assert out.tokens.tolist() == expected[:len(out.tokens)], f"round {r}"
        n = rng.randint(1, len(out.tokens) + 1)
        start = len(tokens) - 1
        new, rows = [rng.randrange(61) for _ in range(n)], torch.randn(n, HIDDEN)
        tokens += new
        hidden = torch.cat([hidden, rows])
        ask = 1 if r % 4 else K
        out = eng.update([SeqUpdate(0, start, tuple(new), rows, num_drafts=ask)])[0]
        assert len(out.tokens) == ask
    assert eng.runner.replays > replays


def test_lossless_on_cuda() -> None:
    target, draft = tied_pair()
    target, draft = target.to(CUDA), draft.to(CUDA)
    ps = prompts(8)
    plain = outputs(engine(target), ps)[0]
    assert outputs(engine(target, draft, k=3), ps)[0] == plain

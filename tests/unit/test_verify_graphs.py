"""The verifier's static-buffer step (what CUDA graphs replay), run eagerly on CPU: it
equals the packed path, padding writes no KV, and engines using it stay lossless."""

from __future__ import annotations

import pytest
import torch

from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.request import Request, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.schedule import Work, WorkKind
from chainspec.engine.verify_batch import _packed_forward
from chainspec.engine.verify_graphs import VerifyGraphs
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair

K = 3


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


def static(eng) -> VerifyGraphs:
    eng.graphs = VerifyGraphs(eng.model, eng.cache, eng.config.max_seqs, K,
                              eng.config.max_len, use_graphs=False, static_on_cpu=True)
    return eng.graphs


def windows(eng, lengths: list[int], drafts: list[int]) -> list[Work]:
    """Verify windows of sequences with `lengths` cached positions, scattered blocks."""
    work = []
    for i, (n, d) in enumerate(zip(lengths, drafts, strict=True)):
        req = Request(str(i), list(range(1, n + 2)), SamplingParams(), StopConditions(), K)
        assert req.blocks.ensure(eng.allocator, n + 1 + K)
        req.num_computed = n
        work.append(Work(req, WorkKind.VERIFY, n, tuple(range(5, 6 + d)), d))
    return work


def test_static_step_equals_packed_step_and_padding_writes_nothing(pair):
    eng = engine(pair[0], max_seqs=8, kv=KVBudget(block_size=4, blocks=100))
    for t in eng.cache.keys + eng.cache.values:
        t.copy_(torch.randn_like(t))  # earlier positions hold something
    before = [t.clone() for t in eng.cache.keys + eng.cache.values]
    work = windows(eng, [5, 17, 9], [3, 0, 2])  # 3 sequences in bucket 4, ragged windows
    graphs = static(eng)
    hidden, offsets = graphs.run(work)
    assert graphs.dispatch(3).batch_size == 4 and graphs.eager_runs == 1
    after_static = [t.clone() for t in eng.cache.keys + eng.cache.values]
    for t, b in zip(eng.cache.keys + eng.cache.values, before, strict=True):
        t.copy_(b)
    packed, packed_offsets = _packed_forward(eng.model, eng.cache, work, torch.device("cpu"))
    for w, a, b in zip(work, offsets, packed_offsets, strict=True):
        torch.testing.assert_close(hidden[a:a + w.num_rows], packed[b:b + w.num_rows])
    bs = eng.cache.block_size
    written = torch.zeros(eng.cache.num_blocks, bs, dtype=torch.bool)
    for w in work:
        for p in range(w.start, w.start + w.num_rows):
            written[w.request.blocks.blocks[p // bs], p % bs] = True
    for old, new, ref in zip(before, after_static, eng.cache.keys + eng.cache.values,
                             strict=True):
        changed = (old != new).any(-1).any(-1)  # [blocks, offsets]
        assert torch.equal(changed, written), "static rows wrote exactly the real rows"
        torch.testing.assert_close(new, ref)  # and the same values as the packed path


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_on_static_buffers_equals_plain(pair, speculative):
    target, draft = pair
    plain = outputs(engine(target), prompts(6), max_tokens=20)[0]
    eng = engine(target, draft if speculative else None, max_seqs=6)
    graphs = static(eng)
    assert outputs(eng, prompts(6), max_tokens=20)[0] == plain
    assert graphs.eager_runs > 0  # decode/verify steps really took the static path

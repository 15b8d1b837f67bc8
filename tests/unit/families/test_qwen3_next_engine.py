"""Qwen3-Next and Qwen3.5-MoE through the verifier engine: greedy plain decoding equals
transformers' own cached greedy decoding; speculative decoding with the family's MTP
drafter (native `mtp.*` layout, an MoE block) equals plain at K = 1..4 and batch 1/3/8;
drafts accepted in part (0..K of them) leave the GDN state exactly right (DESIGN 4.9)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from chainspec.engine.draft_types import DraftResult
from chainspec.engine.kv_budget import KVBudget
from chainspec.models.loader import load_draft_model, load_target
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families.qwen3_next_checkpoint import write_checkpoint

BLOCKS = KVBudget(block_size=4)
CHUNK = 5
MAX_TOKENS = 14
VOCAB = 24  # small: drafts sometimes hit


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 9, 17, 4, 12, 6, 21, 8][:n]  # across chunks of 5 and blocks of 4
    return [torch.randint(0, VOCAB, (m,), generator=gen).tolist() for m in lengths]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}_engine")
    hf = write_checkpoint(request.param, path, seed=5, vocab_size=VOCAB)
    return hf, load_target(path), load_draft_model(path)


@pytest.fixture(scope="module")
def plain(models):
    _, target, _ = models
    eng = engine(target, chunk=CHUNK, kv=BLOCKS)
    return outputs(eng, prompts(8), max_tokens=MAX_TOKENS)[0]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' own cached greedy decoding: the prompt, then one token at a time.
    NOTE: not `generate`, as for Qwen3.5 (tests/unit/families/test_qwen3_5_engine.py): its
    CPU prefill path for these GDN models disagrees with the model's own forward."""
    cache = DynamicCache(config=hf.config)
    logits = hf(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = hf(input_ids=torch.tensor([out[-1:]]), cache=cache, use_cache=True).logits
    return out


def test_greedy_plain_equals_transformers(models, plain):
    hf, _, _ = models
    for prompt, got in zip(prompts(8), plain, strict=True):
        assert got == hf_greedy(hf, prompt, MAX_TOKENS)
    assert len({t for out in plain for t in out}) > 3  # not one repeated token


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_speculative_with_the_mtp_drafter_equals_plain(models, plain, k, batch):
    _, target, draft = models
    eng = engine(target, draft, k=k, chunk=CHUNK, kv=BLOCKS, drafter_kv=BLOCKS,
                 sampled_drafts=False)
    got, drafted, accepted = [], 0, 0
    ps = prompts(8)
    for i in range(0, 8, batch):
        tokens, result = outputs(eng, ps[i:i + batch], max_tokens=MAX_TOKENS)
        got += tokens
        drafted += sum(c.stats.draft_tokens for c in result.completions)
        accepted += sum(c.stats.accepted_tokens for c in result.completions)
    assert got == plain
    assert drafted > 0 and accepted > 0  # the drafter ran and some drafts were kept


class PartlyRightClient:
    """Proposes the true continuation with one wrong draft at a position that varies per
    round (or none), so every accept length 0..K occurs."""

    def __init__(self, ps, truth, k: int) -> None:
        self.full = {i: list(p) + list(t) for i, (p, t) in enumerate(zip(ps, truth, strict=True))}
        self.k, self.ready = k, {}

    def submit(self, updates) -> None:
        for u in updates:
            n = u.start + len(u.tokens)  # the newest committed token
            drafts = (self.full[u.seq_id][n + 1:n + 1 + self.k] + [0] * self.k)[:self.k]
            wrong = (n * 7 + u.seq_id) % (self.k + 1)  # == k: all right
            if wrong < self.k:
                drafts[wrong] = (drafts[wrong] + 1) % VOCAB
            self.ready[u.seq_id] = DraftResult(u.seq_id, n, torch.tensor(drafts))

    def collect(self, wait_for=None):
        ready, self.ready = self.ready, {}
        return ready

    def release(self, ids) -> None:
        pass


def test_every_accept_length_continues_from_the_right_state(models, plain):
    _, target, _ = models
    k, ps = 4, prompts(8)
    eng = engine(target, k=k, chunk=CHUNK, kv=BLOCKS, client=PartlyRightClient(ps, plain, k),
                 sampled_drafts=False)
    got, result = outputs(eng, ps, max_tokens=MAX_TOKENS)
    assert got == plain
    per_pos = [sum(c.stats.accepted_per_pos[i] for c in result.completions) for i in range(k)]
    drafted = sum(c.stats.draft_tokens for c in result.completions)
    assert 0.3 * drafted < sum(per_pos) < 0.9 * drafted and per_pos[-1] > 0

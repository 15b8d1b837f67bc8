"""Prefix caching for hybrid families (Qwen3.5, Qwen3-Next; DESIGN 4.9, 4.12): the GDN
states at block boundaries are snapshotted, a hit starts from the snapshot, output is
that of caching off (greedy and seeded, plain and speculative, under eviction), a second
request computes only its uncached rows, and every snapshot equals the state of a
from-scratch prefill of its prefix: none saw a rejected draft."""

from __future__ import annotations

import random

import pytest
import torch

from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.prefix_cache import chain_hashes
from chainspec.engine.state_snapshots import StateSnapshots
from chainspec.models.attention import AttnBatch, PagedAttention, SeqRows
from chainspec.models.cache_spec import StateSpec
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_draft_model, load_target
from tests.unit.engine_fixtures import PrefillRows, engine, outputs, run_greedy
from tests.unit.families.test_qwen3_5_engine import PartlyRightClient

BS = 4
VOCAB = 24  # small: drafts sometimes hit


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}_hybrid_cache")
    if request.param == "qwen3_5":
        from tests.unit.families.qwen3_5_checkpoint import write_checkpoint
        write_checkpoint(path, seed=5, vocab_size=VOCAB)
    else:
        from tests.unit.families.qwen3_next_checkpoint import write_checkpoint
        write_checkpoint("qwen3_next", path, seed=5, vocab_size=VOCAB)
    return load_target(path), load_draft_model(path)


def _kv(blocks: int, caching: bool, snapshots: int | None = None) -> KVBudget:
    return KVBudget(block_size=BS, blocks=blocks, prefix_caching=caching,
                    state_snapshots=snapshots)


def _shared_prompts(n: int, prefix_len: int = 18, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
            for _ in range(n)]


def _evictions(snapshots: StateSnapshots) -> list[int]:
    """Counts snapshots forgotten to make room (a reserve with no free place)."""
    evicted, reserve = [], snapshots.reserve

    def counting():
        if not snapshots._free and len(snapshots):
            evicted.append(1)
        return reserve()
    snapshots.reserve = counting
    return evicted


def test_a_hybrid_model_caches_prefixes_only_with_snapshots(models):
    target, draft = models
    on = engine(target, k=1, kv=_kv(40, True))
    assert on.allocator.cache is not None and on.claims.snapshots is not None
    assert on.claims.snapshots.count == 8 * 2  # default: max_seqs x kept rows (K+1)
    target.tp = object()  # a TP leader: snapshots would be copied on rank 0 alone
    try:
        tp = engine(target, kv=_kv(40, True))
    finally:
        del target.tp
    assert tp.allocator.cache is None and tp.claims.snapshots is None
    none = engine(target, kv=_kv(40, True, snapshots=0))
    assert none.allocator.cache is None and none.claims.snapshots is None
    off = engine(target, kv=_kv(40, False))
    assert off.allocator.cache is None and off.claims.snapshots is None


def test_the_snapshot_pool_is_sized_by_its_option_from_config_to_engine(models):
    """`state_snapshots` (--state-snapshots): a stack config's value reaches a verifier's
    pool; unset, the pool holds the running states' kept rows; a negative one is refused
    naming the key."""
    from chainspec.cluster.config import StackConfig
    from chainspec.engine.factory import build_verifier_engine
    target, _ = models
    base = {"block_size": BS, "max_model_len": 64, "max_num_seqs": 2,
            "num_speculative_tokens": 2}
    for given, want in ((5, 5), (None, 2 * 3), (0, None)):
        opts = StackConfig.from_dict({**base, "state_snapshots": given}
                                     ).local_options("verifier")
        eng = build_verifier_engine(target, opts, None)
        snaps = eng.claims.snapshots
        assert (None if snaps is None else snaps.count) == want, given
        assert (eng.allocator.cache is not None) == (want is not None)  # 0: no hits
    with pytest.raises(ValueError, match="state_snapshots: input should be greater than "
                                         "or equal to 0"):
        StackConfig.from_dict({**base, "state_snapshots": -1})


CASES = [  # (K, temperature); K None: plain decoding
    (None, 0.0), (None, 0.8), (1, 0.0), (2, 0.0), (3, 0.0), (2, 0.8), (3, 0.8)]


@pytest.mark.parametrize(("k", "temperature"), CASES)
def test_outputs_equal_with_caching_on_and_off_under_eviction(models, k, temperature):
    """Small KV pools and a snapshot pool of 12: blocks and snapshots are evicted along the
    way; greedy and seeded sampling give the tokens of caching off."""
    target, draft = models
    batch = _shared_prompts(8)
    got = {}
    for caching in (False, True):
        eng = engine(target, draft if k else None, k=k or 1, max_seqs=2, chunk=7,
                     kv=_kv(26, caching, 12), drafter_kv=_kv(60, caching),
                     sampled_drafts=False)
        if caching:
            snaps = eng.claims.snapshots
            evicted = _evictions(snaps)
        got[caching] = outputs(eng, batch, 12, temperature)[0]
    assert got[True] == got[False]
    assert snaps.loaded > 0 and eng.allocator.cache.hits > 0  # hits started from snapshots
    assert evicted  # the snapshot pool was too small to keep every boundary
    assert eng.allocator.num_used == 0


@pytest.mark.parametrize(("k", "temperature"), [(2, 0.0), (3, 0.8)])
def test_outputs_equal_with_both_pools_evicting_and_sequences_preempted(models, k,
                                                                        temperature):
    """Pressure everywhere at once: three sequences in a verifier pool that holds fewer
    (preemptions: a preempted hybrid sequence comes back through a hit and a snapshot),
    cached blocks evicted in the verifier and in the drafter (so a verifier hit may miss
    in the drafter), sampled drafts. Greedy and seeded sampling give the tokens of
    caching off."""
    target, draft = models
    batch = _shared_prompts(8)
    got = {}
    for caching in (False, True):
        eng = engine(target, draft, k=k, max_seqs=3, chunk=7, kv=_kv(24, caching, 12),
                     drafter_kv=_kv(34, caching))
        if caching:
            evicted = _evicted_blocks(eng.allocator.cache)
            drafter_evicted = _evicted_blocks(eng.drafter.engine.allocator.cache)
        got[caching], result = outputs(eng, batch, 12, temperature)
    assert got[True] == got[False]
    assert eng.preemptions > 0 and evicted and drafter_evicted
    drafter_cache = eng.drafter.engine.allocator.cache
    assert eng.claims.snapshots.loaded > 0 and drafter_cache.hits > 0
    # every verifier hit is asked of the drafter; one it evicted meanwhile is a miss,
    # and a miss falls back to a resync (DESIGN 4.12), never to other drafts
    assert drafter_cache.queries == eng.allocator.cache.hits
    assert (eng.resyncs > 0) == (drafter_cache.hits < drafter_cache.queries)
    assert sum(c.stats.accepted_tokens for c in result.completions) > 0


def scratch_state(target, tokens: list[int]) -> list[torch.Tensor]:
    """Every recurrent layer's state parts after a prefill of `tokens` from zero."""
    specs = target.cache_specs()
    blocks = -(-len(tokens) // BS)
    cache = ModelKVCache(specs, {None: blocks}, BS, 1, 1)
    batch = AttnBatch.build([SeqRows(list(range(blocks)), 0, len(tokens), {}, 0, -1, False)],
                            BS, with_states=True)
    with torch.no_grad():
        target(torch.tensor(tokens), batch.positions, PagedAttention(cache, batch))
    return [t[0, 0].clone() for i, s in enumerate(specs) if isinstance(s, StateSpec)
            for t in cache.state(i)]


def _slot_state(snapshots: StateSnapshots, slot: int, row: int) -> list[torch.Tensor]:
    return [p[slot, row].clone() for p in snapshots.parts]


def _assert_states_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("k", [None, 3])
def test_a_second_request_computes_only_its_uncached_rows(models, k):
    target, draft = models
    eng = engine(target, draft if k else None, k=k or 1, kv=_kv(200, True),
                 drafter_kv=_kv(200, True))
    eng.observer = rows = PrefillRows()
    snaps = eng.claims.snapshots
    loads = []
    load = snaps.load

    def spy(h, slot):
        load(h, slot)
        loads.append((h, _slot_state(snaps, slot, 0)))
    snaps.load = spy
    prefix = [(7 * i + 3) % VOCAB for i in range(40)]  # 10 full blocks
    run_one(eng, "a", prefix + [5, 6, 7])
    assert rows.prefill["a"] == 43
    second = prefix + [8, 9, 10, 11, 12]
    got = run_one(eng, "b", second)
    # plain: every shared block (40 rows); with a drafter the last one is recomputed
    # (its MTP KV reads the K tokens after it), so the hit ends at block 9's snapshot
    hit = 40 if k is None else 36
    assert eng.allocator.cache.hits == hit and rows.prefill["b"] == len(second) - hit
    assert eng.resyncs == 0  # the drafter found its MTP KV of the hit cached as well
    assert got == run_one(engine(target, draft if k else None, k=k or 1,
                                  kv=_kv(200, False)), "b", second)
    (h, state), = loads
    assert h == chain_hashes(second, BS, [])[hit // BS - 1]
    _assert_states_close(state, scratch_state(target, second[:hit]))


@pytest.mark.parametrize("k", [2, 3])
def test_every_snapshot_equals_a_from_scratch_prefill_of_its_prefix(models, k):
    """Drafts right up to a varying position (every accept length occurs), windows that
    cross block ends: every snapshot, prompt or generated, is the state after its prefix
    alone -- a GDN state that never saw the rejected drafts."""
    target, _ = models
    ps = _shared_prompts(4, prefix_len=9, seed=3)
    truth = outputs(engine(target, kv=_kv(200, False)), ps, 16)[0]
    client = PartlyRightClient(ps, truth, k)
    eng = engine(target, k=k, client=client, kv=_kv(200, True, 400), sampled_drafts=False)
    snaps = eng.claims.snapshots
    verify_rows = []
    save = snaps.save

    def spy(h, slot, row):
        verify_rows.append(row)
        save(h, slot, row)
    snaps.save = spy
    got, result = outputs(eng, ps, 16)
    assert got == truth
    drafted = sum(c.stats.draft_tokens for c in result.completions)
    accepted = sum(c.stats.accepted_tokens for c in result.completions)
    assert 0 < accepted < drafted  # drafts were rejected, and accepted
    assert any(r > 0 for r in verify_rows)  # block ends after accepted drafts
    checked = set()
    for prompt, out in zip(ps, got, strict=True):
        seq = prompt + out
        for j, h in enumerate(chain_hashes(seq, BS, [])):
            if not snaps.holds(h) or h in checked:
                continue
            slot, row = snaps.place(snaps._by_hash[h])
            _assert_states_close(_slot_state(snaps, slot, row),
                                 scratch_state(target, seq[:(j + 1) * BS]))
            checked.add(h)
    assert len(checked) == len(snaps) > len(ps) * 4  # prompt and generated blocks alike


def test_blocks_filled_by_accepted_drafts_are_cached_under_their_true_hashes():
    """A verify window's accepted drafts are appended after its rows are computed: a
    block they complete is cached (and snapshotted) only with its tokens known, so
    every cached hash is one of the sequence's own chain (an attention-only pair whose
    drafts often hit: vocabulary 4)."""
    from tests.unit.engine_fixtures import tied_pair
    target, draft = tied_pair(vocab=4)
    eng = engine(target, draft, k=3, kv=_kv(200, True), drafter_kv=_kv(200, True))
    prompt = [i % 4 for i in range(1, 20)]
    (out,), result = outputs(eng, [prompt], 30)
    assert result.completions[0].stats.accepted_tokens > 5
    seq = prompt + out
    chain = chain_hashes(seq, BS, [])
    cache = eng.allocator.cache
    assert [cache.lookup(h) is not None for h in chain] == [True] * (len(seq) // BS)
    assert cache.num_cached == len(chain)


def test_the_chunked_rule_gives_the_state_after_each_cut_row():
    """Chunks end after every cut row (inside a chunk, at its end, the first row) and the
    states there are the row form's; the outputs and the final state are unchanged."""
    from chainspec.models.gated_deltanet import chunk_bounds, delta_rule_chunked, l2norm
    from tests.unit.families.test_gated_deltanet import rows
    assert chunk_bounds(37, 16, (3, 15, 31)) == [(0, 4), (4, 16), (16, 32), (32, 37)]
    assert chunk_bounds(10, 16, (9,)) == [(0, 10)]  # the last row: the final state
    gen = torch.Generator().manual_seed(0)
    n, h, dk, dv = 37, 3, 8, 6
    q = l2norm(torch.randn(n, h, dk, generator=gen)) * dk ** -0.5
    k = l2norm(torch.randn(n, h, dk, generator=gen))
    v = torch.randn(n, h, dv, generator=gen)
    log_decay, beta = -torch.rand(n, h, generator=gen), torch.rand(n, h, generator=gen)
    state = torch.randn(h, dk, dv, generator=gen)
    cuts, states = [0, 3, 15, 20], []
    out, final = delta_rule_chunked(q, k, v, log_decay, beta, state, cuts=cuts, states=states)
    want_out, want_final = rows(q, k, v, log_decay, beta, state)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)
    assert len(states) == len(cuts)
    for r, got in zip(cuts, states, strict=True):
        _, want = rows(q[:r + 1], k[:r + 1], v[:r + 1], log_decay[:r + 1], beta[:r + 1],
                       state)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- windowed groups in their own pools (MiMo-V2-Flash: window 8, blocks of 4) -------------
@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    from tests.unit.families.mimo_v2_flash_checkpoint import write_checkpoint
    path = tmp_path_factory.mktemp("mimo_prefix_cache")
    write_checkpoint(path, seed=5, vocab_size=VOCAB)
    return load_target(path), load_draft_model(path)


@pytest.mark.parametrize(("k", "temperature"), [(None, 0.0), (2, 0.0), (3, 0.8)])
def test_windowed_outputs_equal_with_caching_on_and_off_under_eviction(windowed, k,
                                                                       temperature):
    """Window blocks given back below the window stay cached (idle); a hit adopts the
    ones its next row sees. Small pools: full blocks are evicted along the way."""
    from tests.unit.families.mimo_v2_flash_checkpoint import WINDOW
    target, draft = windowed
    batch = _shared_prompts(8, prefix_len=21)  # past the window: trimmed blocks are hit
    got = {}
    for caching in (False, True):
        eng = engine(target, draft if k else None, k=k or 1, max_seqs=2, chunk=7,
                     kv=_kv(26, caching), drafter_kv=_kv(60, caching))
        pool = eng.claims.pools[WINDOW]
        evicted = [] if pool.cache is None else _evicted_blocks(eng.allocator.cache)
        got[caching] = outputs(eng, batch, 12, temperature)[0]
    assert got[True] == got[False]
    assert eng.allocator.cache.hits > 0 and pool.cache.num_cached > 0
    assert evicted  # the full-length pool was too small to keep everything
    assert eng.allocator.num_used == 0 and pool.num_used == 0


def _evicted_blocks(cache) -> list[int]:
    evicted, evict = [], cache.evict

    def counting() -> int:
        evicted.append(1)
        return evict()
    cache.evict = counting
    return evicted


def test_a_windowed_hit_computes_only_its_uncached_rows(windowed):
    from tests.unit.families.mimo_v2_flash_checkpoint import WINDOW
    target, _ = windowed
    eng = engine(target, kv=_kv(200, True))
    eng.observer = rows = PrefillRows()
    prefix = [(5 * i + 2) % VOCAB for i in range(40)]  # 10 blocks, far past the window
    run_one(eng, "a", prefix + [1, 2, 3])
    second = prefix + [4, 5, 6, 7]
    adopted = []
    adopt = eng.claims.adopt

    def spy(seq, hashes, n):
        adopt(seq, hashes, n)
        adopted.append([b is not None for b in seq.windows[WINDOW].blocks])
    eng.claims.adopt = spy
    got = run_one(eng, "b", second)
    assert eng.allocator.cache.hits == 40 and rows.prefill["b"] == len(second) - 40
    # the next row (position 40) sees keys 33..40: blocks 8 and 9 of the window group
    assert adopted == [[False] * 8 + [True, True]]
    assert got == run_one(engine(target, kv=_kv(200, False)), "b", second)


def run_one(eng, rid: str, prompt: list[int]) -> list[int]:
    return run_greedy(eng, rid, prompt, max_tokens=6)

"""Prefix caching (DESIGN 4.12): the pool's refcounts and LRU, the hash chain, and through
the engines: a hit skips the cached rows in the verifier and in the drafter, and output is
the same token for token with caching on and off, under eviction pressure."""

from __future__ import annotations

import random

import pytest

from chainspec.engine.block_allocator import BlockAllocator, BlockTable
from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.prefix_cache import PrefixCache, block_hash, chain_hashes
from chainspec.engine.request import StopConditions
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import PrefillRows, engine, outputs, run_greedy, tied_pair

BS = 4


# -- the pool: refcounts, LRU, hash chain ------------------------------------------------
def _cached_table(alloc: BlockAllocator, tokens: list[int]) -> BlockTable:
    """A table over `tokens` whose full blocks are cached (as a commit would)."""
    table = BlockTable()
    assert table.ensure(alloc, len(tokens))
    for h, b in zip(chain_hashes(tokens, alloc.block_size, []), table.blocks, strict=False):
        alloc.cache.insert(h, b)
    return table


def test_a_held_cached_block_is_never_evicted() -> None:
    alloc = BlockAllocator(4, BS, caching=True)
    held = _cached_table(alloc, list(range(8)))  # 2 cached blocks, still held
    idle = _cached_table(alloc, list(range(100, 108)))
    idle_blocks = list(idle.blocks)
    idle.release(alloc)
    assert alloc.num_free == 2  # the idle cached ones count as free
    got = alloc.allocate(2)
    assert sorted(got) == sorted(idle_blocks)  # evicted: the only ones nobody holds
    assert alloc.allocate(1) is None  # only held blocks are left: nothing is evicted
    assert alloc.cache.match(chain_hashes(list(range(8)), BS, [])) == held.blocks


def test_eviction_is_least_recently_used_and_a_hit_refreshes() -> None:
    alloc = BlockAllocator(3, BS, caching=True)
    a, b, c = ([i] * BS for i in (1, 2, 3))
    tables = [_cached_table(alloc, t) for t in (a, b, c)]
    for t in tables:  # released a, then b, then c: a is the oldest idle block
        t.release(alloc)
    ha, hb, hc = (chain_hashes(t, BS, []) for t in (a, b, c))
    hit = alloc.cache.match(ha)  # a is used again, then let go: now the newest
    alloc.hold(hit)
    alloc.free(hit)
    first = alloc.allocate(1)
    assert alloc.cache.match(hb) == [] and alloc.cache.match(ha) and alloc.cache.match(hc)
    second = alloc.allocate(1)
    assert alloc.cache.match(hc) == [] and alloc.cache.match(ha)
    assert first != second


def test_the_same_block_after_a_different_prefix_is_not_a_hit() -> None:
    cache = PrefixCache()
    shared = [7] * BS
    one = chain_hashes([1] * BS + shared, BS, [])
    other = chain_hashes([2] * BS + shared, BS, [])
    assert block_hash(one[0], shared) == one[1] != other[1]
    cache.insert(one[0], 0)
    cache.insert(one[1], 1)
    assert cache.match(other) == []  # second block equal in content, parent differs
    assert cache.match([other[0], one[1]]) == []  # a chain stops at its first miss
    assert cache.match(one) == [0, 1]


def test_refcounts_under_random_sharing_never_hand_out_a_held_block() -> None:
    rng = random.Random(0)
    alloc = BlockAllocator(24, BS, caching=True)
    tables: list[BlockTable] = []
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    for _ in range(600):
        if tables and rng.random() < 0.4:
            tables.pop(rng.randrange(len(tables))).release(alloc)
            continue
        tokens = rng.choice(prefixes)[:rng.choice((4, 8, 12))] + [rng.randrange(5)] * 5
        table, hit = BlockTable(), alloc.cache.match(chain_hashes(tokens, BS, [])[:2])
        idle = sum(alloc.cache.is_idle(b) for b in hit)
        if alloc.blocks_for(len(tokens)) - len(hit) > alloc.num_free - idle:
            continue
        table.adopt(alloc, hit)
        assert table.ensure(alloc, len(tokens))
        for h, b in zip(chain_hashes(tokens, BS, []), table.blocks, strict=False):
            alloc.cache.insert(h, b)
        tables.append(table)
        held = [b for t in tables for b in t.blocks]
        assert all(alloc.refs(b) == held.count(b) for b in set(held))
        assert alloc.num_used == len(set(held))
    for t in tables:
        t.release(alloc)
    assert alloc.num_used == 0 and alloc.num_free == 24


# -- through the engines -------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    return tied_pair()


def _shared_prompts(n: int, prefix_len: int = 22, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(61) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(61) for _ in range(rng.randint(1, 9))] for _ in range(n)]


def _kv(blocks: int, caching: bool) -> KVBudget:
    return KVBudget(block_size=BS, blocks=blocks, prefix_caching=caching)


def _count_evictions(cache: PrefixCache) -> list[int]:
    evicted, evict = [], cache.evict

    def counting() -> int:
        evicted.append(1)
        return evict()
    cache.evict = counting
    return evicted


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_outputs_equal_with_caching_on_and_off_under_eviction(pair, temperature):
    """Seeded sampling and greedy, speculative, with pools small enough that cached
    blocks are evicted in the verifier and in the drafter along the way."""
    target, draft = pair
    batch = _shared_prompts(10)
    off_eng = engine(target, draft, max_seqs=3, kv=_kv(36, False), drafter_kv=_kv(40, False))
    off = outputs(off_eng, batch, 24, temperature)[0]
    assert off_eng.allocator.cache is None and off_eng.drafter.engine.allocator.cache is None
    eng = engine(target, draft, max_seqs=3, kv=_kv(36, True), drafter_kv=_kv(40, True))
    cache, drafter_cache = eng.allocator.cache, eng.drafter.engine.allocator.cache
    evicted, drafter_evicted = _count_evictions(cache), _count_evictions(drafter_cache)
    on, result = outputs(eng, batch, 24, temperature)
    assert on == off
    assert cache.hits > 0 and drafter_cache.hits == drafter_cache.queries > 0
    assert evicted and drafter_evicted  # the pools were too small to keep everything
    assert eng.preemptions > 0  # ... and the verifier's to run three sequences at once
    assert eng.resyncs == 0  # every drafter hit was whole
    assert sum(c.stats.accepted_tokens for c in result.completions) > 0


def test_plain_decoding_matches_a_roomy_run_when_cached_blocks_are_evicted(pair):
    target, _ = pair
    batch = _shared_prompts(10, seed=3)
    roomy = outputs(engine(target, max_seqs=2, kv=_kv(400, False)), batch, 24)[0]
    eng = engine(target, max_seqs=2, kv=_kv(20, True))
    evicted = _count_evictions(eng.allocator.cache)
    assert outputs(eng, batch, 24)[0] == roomy
    assert evicted and eng.allocator.cache.hits > 0
    assert eng.allocator.num_used == 0  # every holder let go; cached blocks are free


def test_a_second_request_prefills_only_what_is_not_cached(pair):
    target, draft = pair
    k = 3
    eng = engine(target, draft, k=k, kv=_kv(200, True), drafter_kv=_kv(200, True))
    eng.observer = rows = PrefillRows()
    drafter = eng.drafter.engine
    prefix = list(range(1, 41))  # 40 tokens: 10 full blocks
    run_one(eng, "a", prefix + [50, 51, 52])
    assert rows.prefill["a"] == 43
    assert drafter.allocator.cache.hits == 0
    run_one(eng, "b", prefix + [53, 54, 55, 56, 57])
    # 10 shared blocks; the last is recomputed: the drafter's MTP KV there reads the
    # K tokens after it, which differ, so it needs the target's hidden rows of it
    assert eng.allocator.cache.hits == 36 and rows.prefill["b"] == 45 - 36
    assert drafter.allocator.cache.queries == 36 and drafter.allocator.cache.hits == 36
    assert eng.resyncs == 0  # the drafter read its MTP KV from its cache: no recompute
    assert eng.allocator.cache.queries == 43 + 45


def test_a_repeated_prompt_keeps_its_last_block_with_a_drafter(pair):
    """A drafter block's MTP KV reads the K tokens after it. Where the prompt itself holds
    them, and they are the tokens that followed the cached block before, the drafter has
    the block under that key: the hit is as long as without a drafter, and the drafter
    reads it all from its cache (no resync). Drafts equal those without caching."""
    target, draft = pair
    k = 3
    prompt = list(range(1, 44))  # 43 tokens: 10 blocks before the last row, 3 after them
    got = {}
    for caching in (False, True):
        eng = engine(target, draft, k=k, max_seqs=1, kv=_kv(200, caching),
                     drafter_kv=_kv(200, caching))
        eng.observer = rows = PrefillRows()
        toks, result = outputs(eng, [prompt, prompt], 12)
        got[caching] = toks, [c.stats.accepted_per_pos for c in result.completions]
        assert sorted(rows.prefill.values()) == ([3, 43] if caching else [43, 43])
    assert got[True] == got[False]
    eng = engine(target, draft, k=k, kv=_kv(200, True), drafter_kv=_kv(200, True))
    eng.observer = rows = PrefillRows()
    first, again = run_one(eng, "a", prompt), run_one(eng, "b", prompt)
    assert again == first
    assert rows.prefill["b"] == 3  # as plain decoding's: 40 positions read from the cache
    drafter = eng.drafter.engine.allocator.cache
    assert (drafter.queries, drafter.hits) == (40, 40) and eng.resyncs == 0
    # the same 40 tokens then other ones: the last block's key differs, so it is recomputed
    run_one(eng, "c", prompt[:40] + [7, 8, 9, 10])
    assert rows.prefill["c"] == 44 - 36 and eng.resyncs == 0
    assert (drafter.queries, drafter.hits) == (76, 76)


@pytest.mark.parametrize("cap", [None, 1])
def test_a_next_turn_reads_only_blocks_the_drafter_was_told_to_cache(pair, cap):
    """A chat's next turn extends the last turn's text past where the drafter's KV
    was final (the last round's rows never go to the drafter), and a request capped at
    1 draft asks for 1-step rounds, whose deeper steps lag and cache nothing. A hit
    ends where the drafter was not sent a block's key (capped: at once): so never a
    resync, and the same tokens as without caching."""
    target, draft = pair
    k = 3
    first = list(range(1, 31))
    got = {}
    for caching in (False, True):
        eng = engine(target, draft, k=k, kv=_kv(200, caching), drafter_kv=_kv(200, caching))
        turns, prompt = [], first
        for turn in range(3):
            eng.add_request(f"t{turn}", prompt, SamplingParams(temperature=0.0),
                            StopConditions(max_tokens=11), num_speculative_tokens=cap)
            out = []
            while eng.has_work:
                for o in eng.step():
                    out.extend(o.new_tokens)
            turns.append(out)
            prompt = prompt + out + [40 + turn, 41, 42, 43, 44]
        got[caching] = turns
        if caching:
            assert eng.resyncs == 0
            drafter = eng.drafter.engine.allocator.cache
            assert drafter.hits == drafter.queries
            # capped, the drafter never held a block: nothing is read from the cache
            assert (eng.allocator.cache.hits > 0) == (cap is None) == (drafter.hits > 0)
    assert got[True] == got[False]


class PlainThenDrafts:
    """A stand-in adaptive policy: plain decoding for its first `plain_for` steps, then
    every sequence at its cap."""

    ask = 0

    def __init__(self, plain_for: int) -> None:
        self.left, self.plain_steps = plain_for, 1  # NOTE: a spell already runs

    def depths(self, keys, caps, other_rows=0, demand=0):
        self.left -= 1
        self.plain_steps = self.plain_steps + 1 if self.left >= 0 else 0
        return [0] * len(caps) if self.left >= 0 else list(caps)

    def observe_round(self, key, num_drafts, accepted):
        pass

    def observe_step(self, *args, **kwargs):
        pass

    def forget(self, key):
        pass


def test_a_prompt_admitted_while_nobody_drafts_reads_its_whole_hit(pair):
    """During a plain spell the drafter is sent nothing, so it holds no key of the
    prompts the spell saw: a prompt admitted then reads its whole hit, as plain decoding
    does. When drafting resumes in its life its drafter state is rebuilt (a resync), and
    the output is plain decoding's."""
    target, draft = pair
    prompt = list(range(1, 27))  # 26 tokens: 6 blocks of 4 before the last row
    plain = engine(target, kv=_kv(200, True))
    plain.observer = plain_rows = PrefillRows()
    want = [run_greedy(plain, rid, prompt, 16) for rid in ("a", "b")]
    eng = engine(target, draft, k=3, kv=_kv(200, True), drafter_kv=_kv(200, True))
    eng.observer = rows = PrefillRows()
    eng.depth = PlainThenDrafts(plain_for=24)  # "a" ends plain; "b" starts plain, drafts
    got = [run_greedy(eng, "a", prompt, 16)]
    eng.add_request("b", prompt, SamplingParams(temperature=0.0), StopConditions(max_tokens=16))
    got.append([])
    while eng.has_work:
        for out in eng.step():
            got[-1].extend(out.new_tokens)
            final = out.stats or None
    assert got == want
    assert rows.prefill == plain_rows.prefill == {"a": 26, "b": 2}
    assert eng.resyncs == 1  # "b", once drafting resumed: the drafter never saw "a"
    assert final.accepted_tokens > 0  # it drafted after


def test_a_held_prompt_with_a_hit_opens_from_the_drafters_cache(pair):
    """Adaptive depth holds the rows of a sequence that drafts nothing (4.11), a prompt's
    too when it read a prefix from the cache: the update that sends them later starts at
    the hit and names the cached blocks, so the drafter reads them (no resync), and the
    output is plain decoding's."""
    from tests.unit.engine_fixtures import RandomDepth
    target, draft = pair
    k = 3
    batch = [list(range(1, 44))] * 3 + _shared_prompts(5, prefix_len=30, seed=9)
    plain = outputs(engine(target, kv=_kv(400, False)), batch, 16)[0]
    held_opens = 0
    for seed in range(4):
        eng = engine(target, draft, k=k, max_seqs=3, kv=_kv(400, True),
                     drafter_kv=_kv(400, True))
        # NOTE: both caches first hold the prefixes (a drafter lacking a block the
        # verifier hit resyncs, by design: test_a_drafter_miss_asks_for_a_resync...)
        outputs(eng, [batch[0], batch[3]], 4)
        eng.depth = RandomDepth(seed, k)
        first, submit = {}, eng.drafter.submit  # each sequence's first update

        def recording(updates, submit=submit, first=first):
            for u in updates:
                first.setdefault(u.seq_id, u)
            return submit(updates)
        eng.drafter.submit = recording
        assert outputs(eng, batch, 16)[0] == plain
        assert eng.resyncs == 0
        drafter = eng.drafter.engine.allocator.cache
        assert drafter.hits == drafter.queries > 0
        # opened past 0 with decode rows in it: rows held since the prompt's prefill
        held_opens += sum(u.start > 0 and u.end > len(batch[seq - 2])
                          for seq, u in first.items())
    assert held_opens, "no prompt with a hit was ever held: the test drives nothing"


def test_a_fully_cached_prompt_still_computes_its_last_block(pair):
    target, _ = pair
    eng = engine(target, kv=_kv(200, True))
    eng.observer = rows = PrefillRows()
    prompt = list(range(1, 33))  # 8 full blocks
    first = run_one(eng, "a", prompt)
    again = run_one(eng, "b", prompt)
    assert again == first
    assert rows.prefill["b"] == BS  # the last block recomputed: logits, and no shared write


def test_drafts_after_a_drafter_hit_equal_those_without_caching(pair):
    """Acceptance (a function of the drafts) is unchanged by reading the MTP KV from the
    drafter's cache: the drafter state restored on a hit is exact."""
    target, draft = pair
    batch = _shared_prompts(6, prefix_len=30, seed=5)
    stats = {}
    for caching in (False, True):
        eng = engine(target, draft, max_seqs=1, kv=_kv(400, caching),
                     drafter_kv=_kv(400, caching))
        toks, result = outputs(eng, batch, 20)
        stats[caching] = toks, [c.stats.accepted_per_pos for c in result.completions]
        if caching:
            assert eng.drafter.engine.allocator.cache.hits > 0 and eng.resyncs == 0
    assert stats[True] == stats[False]


def test_cached_tokens_reach_the_request_stats(pair):
    target, _ = pair
    eng = engine(target, kv=_kv(200, True))
    prompt = list(range(1, 30))
    for rid in ("a", "b"):
        eng.add_request(rid, prompt, SamplingParams(), StopConditions(max_tokens=4))
        final = None
        while eng.has_work:
            for out in eng.step():
                final = out.stats or final
        assert final.cached_tokens == (0 if rid == "a" else 28)


def test_hits_reach_both_engines_metrics_and_the_usage_body(pair):
    from chainspec.gateway.responses import usage
    from chainspec.metrics.drafter import DrafterMetrics
    from chainspec.metrics.verifier import VerifierMetrics
    from chainspec.rpc.generate_codec import stats_message
    target, draft = pair
    eng = engine(target, draft, kv=_kv(200, True), drafter_kv=_kv(200, True))
    vm, dm = VerifierMetrics("tiny", 3), DrafterMetrics("tiny", 3)
    vm.attach(eng, None)
    eng.drafter.engine.observer = dm
    prefix = list(range(1, 41))
    run_one(eng, "a", prefix + [50])
    eng.add_request("b", prefix + [51, 52], SamplingParams(), StopConditions(max_tokens=3))
    final = None
    while eng.has_work:
        final = next((o.stats for o in eng.step() if o.stats), final)

    def value(metrics, name):
        return metrics.registry.get_sample_value(name, {"model_name": "tiny"})
    assert value(vm, "chainspec_prefix_cache_queries_total") == 41 + 42
    assert value(vm, "chainspec_prefix_cache_hits_total") == 36 == final.cached_tokens
    assert value(dm, "chainspec_drafter_prefix_cache_queries_total") == 36
    assert value(dm, "chainspec_drafter_prefix_cache_hits_total") == 36
    body = usage(stats_message(final, 42, 3))
    assert body["prompt_tokens_details"] == {"cached_tokens": 36}


def test_cache_keys_cross_the_wire_and_bad_ones_fail_their_sequence():
    import torch

    from chainspec.engine.draft_types import SeqUpdate, UpdateBatch
    from chainspec.rpc import draft_codec as dc
    limits = dc.DraftLimits(hidden_size=8, vocab_size=100, num_draft_tokens=3, max_rows=16)
    keys = ((16, bytes(range(16))), (32, bytes(range(1, 17))))
    upd = SeqUpdate(1, 32, (5, 6), torch.randn(2, 8), cache_keys=keys)
    msg = dc.encode_draft_request(UpdateBatch(1, (upd,)))
    batch, failures = dc.decode_draft_request(type(msg).FromString(msg.SerializeToString()),
                                              limits)
    assert failures == () and batch.updates[0].cache_keys == keys
    msg.updates[0].cache_keys[1] = b"short"
    batch, (failure,) = dc.decode_draft_request(msg, limits)
    assert batch.updates == () and "16 bytes" in failure.message
    msg.updates[0].cache_key_ends.append(48)
    _, (failure,) = dc.decode_draft_request(msg, limits)
    assert "3 cache_key_ends but 2 cache_keys" in failure.message


def test_which_cache_layouts_cache_prefixes():
    """Recurrent states turn prefix caching off where nothing snapshots them (the
    verifier does: tests/unit/test_prefix_cache_hybrid.py); windowed groups cache their
    blocks in their own pools or, in the drafter, in the full-length one."""
    import torch

    from chainspec.engine.kv_budget import model_cache
    from chainspec.models.cache_spec import PagedSpec, StateSpec
    full, windowed = PagedSpec(2, 8), PagedSpec(2, 8, window=8)

    def caching(specs, separate_windows=True) -> bool:
        _, alloc, _ = model_cache(specs, _kv(16, True), 2, 64, 8, 4, torch.float32,
                                  torch.device("cpu"), separate_windows)
        return alloc.cache is not None
    assert caching([full, full])
    assert not caching([full, StateSpec(((4, 3),))])
    assert caching([full, windowed])  # windowed groups cache their blocks too
    assert caching([full, windowed], separate_windows=False)  # the drafter's layout
    _, off, _ = model_cache([full], _kv(16, False), 2, 64, 8, 4, torch.float32,
                            torch.device("cpu"))
    assert off.cache is None


def test_latent_attention_family_is_lossless_with_hits(tmp_path):
    """DeepSeek-V3 (MLA: a latent paged cache) with an MTP layer of its own kind: shared
    prefixes hit in both engines and output is that of caching off."""
    from chainspec.models.loader import load_draft_model, load_target
    from tests.unit.families.deepseek_v3_checkpoint import write_with_mtp
    write_with_mtp(tmp_path, agreeing=True)
    target, draft = load_target(tmp_path), load_draft_model(tmp_path)
    vocab = target.config.vocab_size
    batch = [p[:vocab] for p in _shared_prompts(6, prefix_len=21, seed=7)]
    batch = [[t % vocab for t in p] for p in batch]
    got = {}
    for caching in (False, True):
        eng = engine(target, draft, k=2, max_seqs=2, chunk=5, kv=_kv(60, caching),
                     drafter_kv=_kv(60, caching))
        got[caching] = outputs(eng, batch, 12)[0]
    assert got[True] == got[False]
    assert eng.allocator.cache.hits > 0 and eng.drafter.engine.allocator.cache.hits > 0
    assert eng.resyncs == 0


def test_a_drafter_miss_asks_for_a_resync_and_a_full_drafter_refuses(pair):
    import torch

    from chainspec.engine.draft_types import ErrorCode, SeqUpdate
    from chainspec.engine.drafter import DrafterConfig, DrafterEngine
    _, draft = pair
    eng = DrafterEngine(draft, DrafterConfig(num_steps=3, max_seqs=1, max_len=64,
                                             kv=_kv(32, True)))
    h = draft.config.hidden_size
    keys = tuple((e, bytes([e]) * 16) for e in (4, 8))  # never cached
    (miss,) = eng.update([SeqUpdate(1, 8, (5, 6), torch.randn(2, h), cache_keys=keys)])
    assert miss.code == ErrorCode.FAILED_PRECONDITION and 1 not in eng.seqs
    assert (eng.allocator.cache.queries, eng.allocator.cache.hits) == (8, 0)
    eng.update([SeqUpdate(2, 0, (1, 2, 3), torch.randn(3, h))])  # takes the only slot
    (full,) = eng.update([SeqUpdate(3, 8, (5, 6), torch.randn(2, h), cache_keys=keys)])
    assert full.code == ErrorCode.RESOURCE_EXHAUSTED and 3 not in eng.seqs
    # a decode update of a sequence the drafter lost is no prefix lookup
    (lost,) = eng.update([SeqUpdate(4, 9, (5,), torch.randn(1, h))])
    assert lost.code == ErrorCode.FAILED_PRECONDITION and eng.allocator.cache.queries == 8


def test_a_cache_salt_shares_blocks_only_within_itself(pair):
    target, _ = pair
    eng = engine(target, kv=_kv(200, True))
    eng.observer = rows = PrefillRows()
    prompt = list(range(1, 30))

    def run(rid: str, salt: str | None) -> list[int]:
        eng.add_request(rid, prompt, SamplingParams(temperature=0.0),
                        StopConditions(max_tokens=4), cache_salt=salt)
        got = []
        while eng.has_work:
            for out in eng.step():
                got.extend(out.new_tokens)
        return got
    plain = run("plain", None)
    assert run("a1", "tenant-a") == plain and rows.prefill["a1"] == 29  # not the unsalted
    assert run("b1", "tenant-b") == plain and rows.prefill["b1"] == 29  # nor a's
    assert run("a2", "tenant-a") == plain and rows.prefill["a2"] == 29 - 28  # a's own
    assert run("plain2", None) == plain and rows.prefill["plain2"] == 1


def run_one(eng, rid: str, prompt: list[int]) -> list[int]:
    return run_greedy(eng, rid, prompt, max_tokens=8)

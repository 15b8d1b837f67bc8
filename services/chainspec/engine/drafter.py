"""The drafter engine: per-sequence state and batched draft rounds (DESIGN 3.1-3.2, 4.1).

Per sequence it keeps a block table into a paged KV cache (one KV layer per draft step)
and the last K-1 committed rows (h_p, x[p+1]). Each update's window starts with those
history rows, so every KV entry that survives a round was computed from committed tokens only.

Drafter-side depth (DESIGN 4.11): a round runs D <= K draft steps, the most its updates
ask for (`SeqUpdate.num_drafts`). Steps above D write no KV that round, so each sequence
keeps, per step k, the last position whose step-k KV was computed from committed inputs
(`valid`), and the committed rows from the lowest of them on (`hist_*`). A round of depth
D starts each window just past step D's valid position: those rows are recomputed by
every step that runs, in order, so a lagging step catches up within the round that runs
it. A sequence whose lag would pass `lag_rows` asks for all K steps (one wide round).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from chainspec.engine.block_allocator import BlockTable
from chainspec.engine.draft_batch import Window, build_compact
from chainspec.engine.draft_step import DraftOutput, draft_round
from chainspec.engine.draft_types import (
    DraftResult,
    ErrorCode,
    SeqFailure,
    SeqOutcome,
    SeqUpdate,
)
from chainspec.engine.drafter_ahead import DraftAheadRounds
from chainspec.engine.graph_runner import GraphRunner, StaticDraftBuffers, default_buckets
from chainspec.engine.kv_budget import KVBudget, model_cache
from chainspec.engine.lookahead import (
    AcceptRates,
    AheadClock,
    AheadSource,
    Hypothesis,
)
from chainspec.engine.observer import DrafterObserver, DraftRoundRecord
from chainspec.engine.step_clock import StepClock
from chainspec.models.mtp import MTPDraftModel
from chainspec.spine.sections import StackSection
from chainspec.spine.sections import default as spine_default


@dataclass(frozen=True)
class DrafterConfig:
    # NOTE: the spine's defaults (engine/factory.py sets every one from LocalOptions)
    num_steps: int = spine_default(StackSection, "num_speculative_tokens")  # K
    chain: bool = spine_default(StackSection, "chain")
    # cap on sequences held (KV memory is `kv`'s business)
    max_seqs: int = spine_default(StackSection, "drafter_max_num_seqs")
    max_len: int = spine_default(StackSection, "max_model_len")
    top_k: int = spine_default(StackSection, "draft_top_k")  # support of sampled drafts
    use_graphs: bool = not spine_default(StackSection, "enforce_eager")  # on a GPU
    max_graph_batch: int = 64
    # draft-ahead (lookahead.py): bonus/correction guesses per accept length, and rows
    # of hypothesis windows per look-ahead round (bounds its time beside a verify step)
    ahead_fanout: int = 2
    ahead_rows: int = 48
    # None: the corrections and the second round as far as they fit in the verifier's
    # step (lookahead.AheadClock); True / False: always / never a second round
    ahead_second_round: bool | None = None
    # drafter-side depth: committed rows a lagging step may fall behind before its
    # sequence asks for a full-depth round (the catch-up window's size, at most)
    lag_rows: int = 64
    kv: KVBudget = field(default_factory=KVBudget)  # paged KV cache size

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps (K) must be >= 1, got {self.num_steps}")
        if self.max_seqs < 1 or self.max_len < 2 * self.num_steps + 1:
            raise ValueError("max_seqs must be >= 1 and max_len > 2K")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.lag_rows < 2 * self.num_steps:
            raise ValueError(f"lag_rows must be >= 2K = {2 * self.num_steps}, "
                             f"got {self.lag_rows}")


class _SeqState:
    def __init__(self, seed: int, num_steps: int, valid_to: int = -1) -> None:
        self.blocks = BlockTable()
        self.seed = seed
        self.next_start = 0  # the `start` the next update must carry
        # valid[k-1]: the last position whose step-k KV came from committed inputs only
        self.valid = [valid_to] * num_steps
        self.hist_hidden: torch.Tensor | None = None  # [m, H]: h of rows valid[K-1]+1 ..
        self.hist_tokens: torch.Tensor | None = None  # [m]: x[p+1] of those rows
        self.verifying = 0  # drafts the verifier checks now (a look-ahead asked for)
        self.pending_keys: list[tuple[int, bytes]] = []  # cache keys of blocks not final yet

    def reset(self) -> None:
        self.next_start, self.hist_hidden, self.hist_tokens = 0, None, None
        self.valid = [-1] * len(self.valid)
        self.pending_keys = []


class DrafterEngine(DraftAheadRounds):
    """`update(batch of SeqUpdate) -> list of DraftResult | SeqFailure`, one per update."""

    def __init__(self, model: MTPDraftModel, config: DrafterConfig,
                 observer: DrafterObserver | None = None) -> None:
        self.model = model.eval()
        self.config = config
        self.observer = observer  # metrics: told about every update (host values only)
        self._clock: StepClock | None = None  # times this round's steps (observer only)
        self.vocab_size = model.config.vocab_size
        self.hidden_size = model.config.hidden_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        c = config
        # NOTE: windowed MTP layers keep every position (masked by their window): the
        # drafter's exact-boundary windows reread history rows, nothing is given back
        self.cache, self.allocator, _ = model_cache(
            model.cache_specs(c.num_steps), c.kv, c.max_seqs, c.max_len, 1, 1, self.dtype,
            self.device, separate_windows=False)
        self.seqs: dict[int, _SeqState] = {}
        self._ahead: list[AheadSource] = []  # asked for by the last update, not yet run
        self.ahead_rounds = 0
        self.accept_rates = AcceptRates(c.num_steps)  # ranks look-ahead hypotheses
        # how many look-ahead rows fit in the verifier's step; None: no bound but
        # `ahead_rows` (in process, where the verifier waits for the look-ahead anyway)
        self.ahead_clock: AheadClock | None = AheadClock()
        self.ahead_plan: list[Hypothesis] = []  # behind the last look-ahead's entries
        self._hist_rows: dict[int, int] = {}  # history rows of the last look-ahead's windows
        # full-K entries' chain states at their last row: an early look-ahead's source,
        # by (seq_id, the entry's drafts' position, the drafts)
        self._chained: dict[tuple[int, int, tuple[int, ...]], AheadSource] = {}
        self._early: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._first = None  # the first look-ahead round of the last update's hits
        self._observed_prefix = (0, 0)  # prefix-cache counters the observer has seen
        graph_batch = min(c.max_graph_batch, c.max_seqs)
        buffers = StaticDraftBuffers(graph_batch, c.num_steps, self.hidden_size, c.max_len,
                                     c.kv.block_size, self.device, self.dtype)
        self.runner = GraphRunner(self._round, buffers, default_buckets(graph_batch),
                                  c.use_graphs, range(1, c.num_steps + 1))
        self.runner.capture()

    def _round(self, batch, depth: int | None = None) -> DraftOutput:
        c = self.config
        # NOTE: _clock is None while capturing (in __init__): a graph records no marks
        return draft_round(self.model, self.cache, batch, depth or c.num_steps, c.chain,
                           c.top_k, self._clock)

    @property
    def load(self) -> int:
        return len(self.seqs)

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            state = self.seqs.pop(seq_id, None)
            if state is not None:
                state.blocks.release(self.allocator)
            self._chained = {k: s for k, s in self._chained.items() if k[0] != seq_id}
        if self.observer is not None:
            self._observe_occupancy()

    @torch.inference_mode()
    def update(self, updates: Sequence[SeqUpdate],
               rest_of: list[AheadSource] | None = None) -> list[SeqOutcome]:
        """Apply updates and draft. Bad updates fail alone; the others proceed.
        `rest_of`: these updates are the rest of a batch whose first part the last
        update answered, and these look-ahead sources of it (`pending_ahead`) draft
        their first round in this round (`split_hits`)."""
        started = time.perf_counter()
        timed = self.ahead_clock is not None and rest_of is None and \
            any(u.look_ahead for u in updates)
        if timed:
            self.ahead_clock.update_started(started)
        outcomes: list[SeqOutcome | None] = [None] * len(updates)
        accepted: list[tuple[int, SeqUpdate, Window]] = []
        seen: set[int] = set()
        for i, upd in enumerate(updates):
            failure = self._check(upd, seen)
            if failure is None:
                window, failure = self._open_window(upd)
            if failure is not None:
                outcomes[i] = failure
                continue
            seen.add(upd.seq_id)
            accepted.append((i, upd, window))
        depth = self._round_depth(accepted)
        windows = [self._at_depth(u, w, depth) for _, u, w in accepted]
        self._clock = StepClock(self.device) if self.observer is not None else None
        eager_reason = None
        self._ahead = []
        if accepted:
            out, eager_reason, hits, merged = self._run_with_early(
                [u for _, u, _ in accepted], windows, rest_of or [], depth)
            for row, (i, upd, window) in enumerate(accepted):
                self._commit(upd, window, depth)
                outcomes[i] = self._result(upd, out, row)
                if upd.seq_id in hits:  # a hit: its look-ahead starts from the entry's chain
                    self.seqs[upd.seq_id].verifying = len(upd.verifying)
                    if not merged:
                        self._ahead.append(hits[upd.seq_id])
                elif upd.look_ahead and upd.want_drafts and self.config.num_steps > 1:
                    self._ahead.append(self._ahead_source(upd, window, out, row))
        if timed:  # NOTE: the rest of a batch: the verifier waited for its first part
            if self._ahead:
                self.ahead_clock.exact_done(time.perf_counter() - started)
            self.ahead_clock.answered(time.perf_counter(), hit=not self._ahead)
        if self.observer is not None:
            self._observe(started, windows, eager_reason, outcomes, depth)
        return outcomes  # type: ignore[return-value]

    def _round_depth(self, accepted: list[tuple[int, SeqUpdate, Window]]) -> int:
        """Draft steps this round runs: the most any update asks for. An update that asks
        for no drafts (a prompt's chunk), asks for a look-ahead (built on all K), or whose
        full-depth window would pass `lag_rows` (a step lagging too far) asks for K."""
        K, most = self.config.num_steps, 1
        for _, upd, window in accepted:
            full = not upd.want_drafts or upd.look_ahead or \
                window.num_rows > self.config.lag_rows
            most = max(most, K if full else min(upd.num_drafts or K, K))
        return most

    def _at_depth(self, upd: SeqUpdate, window: Window, depth: int) -> Window:
        """`window` (from the lowest row any step lacks) cut to the rows a round of
        `depth` steps must recompute: past step `depth`'s last valid position (the
        steps below it are valid at least as far)."""
        first = max(window.first_pos, self.seqs[upd.seq_id].valid[depth - 1] + 1)
        if first == window.first_pos:
            return window
        cut = first - window.first_pos
        return replace(window, first_pos=first, hidden=window.hidden[cut:],
                       tokens=window.tokens[cut:])

    def _observe(self, started: float, windows: list[Window], eager_reason: str | None,
                 outcomes: list[SeqOutcome], depth: int) -> None:
        refused = sum(isinstance(o, SeqFailure) and o.code == ErrorCode.FAILED_PRECONDITION
                      for o in outcomes)
        cache = self.allocator.cache
        queried, hit = (cache.queries, cache.hits) if cache is not None else (0, 0)
        self.observer.update_done(DraftRoundRecord(
            time.perf_counter() - started, [w.num_rows for w in windows],
            bool(windows) and eager_reason is None, eager_reason, self._clock.durations(),
            refused, queried - self._observed_prefix[0], hit - self._observed_prefix[1],
            depth if windows else 0))
        self._observed_prefix = (queried, hit)
        self._observe_occupancy()

    def _observe_occupancy(self) -> None:
        self.observer.occupancy(len(self.seqs), self.allocator.usage)

    def _check(self, upd: SeqUpdate, seen: set[int]) -> SeqFailure | None:
        def bad(msg: str) -> SeqFailure:
            return SeqFailure(upd.seq_id, ErrorCode.INVALID_ARGUMENT, msg)
        n = len(upd.tokens)
        if upd.seq_id in seen:
            return bad(f"sequence {upd.seq_id} appears twice in one batch")
        if n == 0:
            return bad("an update needs at least one token")
        if tuple(upd.hidden.shape) != (n, self.hidden_size):
            return bad(f"hidden has shape {tuple(upd.hidden.shape)}, "
                       f"expected [{n}, {self.hidden_size}] (one row per token)")
        if not all(0 <= t < self.vocab_size for t in upd.tokens):
            return bad(f"token id out of range [0, {self.vocab_size})")
        if len(upd.verifying) > self.config.num_steps or \
                not all(0 <= t < self.vocab_size for t in upd.verifying):
            return bad(f"verifying holds {len(upd.verifying)} tokens; expected at most "
                       f"K = {self.config.num_steps}, each in [0, {self.vocab_size})")
        if not bool(torch.isfinite(upd.hidden).all()):
            return bad("hidden contains non-finite values")
        if upd.start < 0 or upd.start + n + self.config.num_steps > self.config.max_len:
            return SeqFailure(upd.seq_id, ErrorCode.RESOURCE_EXHAUSTED,
                              f"rows up to {upd.start + n} exceed the drafter's max_len "
                              f"{self.config.max_len} minus K")
        return None

    def _open_window(self, upd: SeqUpdate) -> tuple[Window | None, SeqFailure | None]:
        state = self.seqs.get(upd.seq_id)
        opens = upd.start == 0 or (state is None and upd.opens_from_cache)
        if opens and state is None and len(self.seqs) >= self.config.max_seqs:
            return None, SeqFailure(upd.seq_id, ErrorCode.RESOURCE_EXHAUSTED,
                                    f"drafter is full ({self.config.max_seqs} sequences)")
        if upd.start == 0:  # a new sequence, or a resync from scratch
            if state is None:
                state = _SeqState(_signed64(upd.sampling.seed), self.config.num_steps)
                self.seqs[upd.seq_id] = state
            state.blocks.release(self.allocator)  # NOTE: some may be shared: write fresh ones
            state.reset()
        elif opens and self._restore(upd):  # a prefix the verifier read from its cache
            state = self.seqs[upd.seq_id]
        elif state is None or upd.start != state.next_start:
            expected = None if state is None else state.next_start
            what = "unknown sequence" if state is None else f"expected start {expected}"
            return None, SeqFailure(upd.seq_id, ErrorCode.FAILED_PRECONDITION,
                                    f"cannot continue sequence {upd.seq_id} at start "
                                    f"{upd.start}: {what}", expected)
        if not state.blocks.ensure(self.allocator, upd.start + len(upd.tokens)):
            # NOTE: the sequence leaves (blocks freed for the others); the verifier decodes
            # it plainly and resyncs it later. No round ran, so no draft is wrong.
            self.release([upd.seq_id])
            return None, SeqFailure(upd.seq_id, ErrorCode.RESOURCE_EXHAUSTED,
                                    f"drafter is out of KV blocks ({self.allocator.num_blocks}"
                                    f" of {self.allocator.block_size} positions)")
        hidden = upd.hidden.to(self.dtype)
        tokens = torch.tensor(upd.tokens, dtype=torch.int64)
        if state.hist_hidden is not None:
            hidden = torch.cat([state.hist_hidden, hidden])
            tokens = torch.cat([state.hist_tokens, tokens])
        m = 0 if state.hist_hidden is None else state.hist_hidden.shape[0]
        return Window(tuple(state.blocks.blocks), upd.start - m, hidden, tokens,
                      upd.sampling.temperature, state.seed), None

    def _restore(self, upd: SeqUpdate) -> bool:
        """A new sequence whose prefix below `upd.start` the verifier read from its prefix
        cache: take the MTP KV of that prefix from ours (DESIGN 4.12), or False (a miss:
        the verifier resyncs). NOTE: no history rows: every cached block is final (its
        KV was computed from the committed tokens the key covers), and the window starts
        at `start`, so no row below it is written again."""
        cache, bs = self.allocator.cache, self.allocator.block_size
        if cache is None:
            return False
        keys = dict(upd.cache_keys)
        blocks = [cache.lookup(keys[e]) if e in keys else None
                  for e in range(bs, upd.start + 1, bs)]
        hit = upd.start % bs == 0 and None not in blocks
        cache.record(upd.start, upd.start if hit else 0)
        if not hit:
            return False
        state = _SeqState(_signed64(upd.sampling.seed), self.config.num_steps, upd.start - 1)
        state.blocks.adopt(self.allocator, blocks)
        state.next_start = upd.start
        self.seqs[upd.seq_id] = state
        return True

    def _cache_final(self, upd: SeqUpdate, state: _SeqState) -> None:
        """Cache the blocks `upd` names whose KV is final: every position p in them has
        p <= valid[K-1] (next_start - K after a full-depth round), so no later window
        rewrites it (DESIGN 3.2). Blocks a lagging step has not reached wait for it."""
        cache, bs = self.allocator.cache, self.allocator.block_size
        if cache is None:
            return
        final = state.valid[-1] + 1  # every step's KV below it is final
        keys, state.pending_keys = state.pending_keys + list(upd.cache_keys), []
        for end, key in keys:
            if end % bs or end // bs > len(state.blocks):
                continue
            if end <= final:
                cache.insert(key, state.blocks.blocks[end // bs - 1])
            else:
                state.pending_keys.append((end, key))

    def _run(self, windows: list[Window], depth: int | None = None
             ) -> tuple[DraftOutput, str | None]:
        """The round's drafts (`depth` steps, default K), and why it ran eagerly (None: a
        CUDA graph replayed)."""
        if self.runner.fits(windows):
            replays = self.runner.replays
            out = self.runner.run(windows, depth)
            return out, None if self.runner.replays > replays else "no_graph"
        self.runner.eager_runs += 1
        reason = "batch_too_large" if len(windows) > self.runner.max_batch \
            else "window_too_large"
        return self._round(build_compact(windows, self.config.num_steps,
                                         self.config.kv.block_size, self.device,
                                         self.dtype), depth), reason

    def _commit(self, upd: SeqUpdate, window: Window, depth: int) -> None:
        """Record which steps' KV is now committed-only (the `depth` that ran), and keep
        the committed rows from the lowest position a step lacks as the next window's
        history: the last K-1 after a full-depth round."""
        state = self.seqs[upd.seq_id]
        if state.verifying and upd.start == state.next_start > 0:  # a verdict on them
            self.accept_rates.record(state.verifying, len(upd.tokens) - 1)
        state.verifying = 0
        state.next_start = end = upd.start + len(upd.tokens)
        for k in range(1, depth + 1):  # step k's row p read x[p+k]: committed for p <= N'-k
            state.valid[k - 1] = max(state.valid[k - 1], end - k)
        self._cache_final(upd, state)
        keep = end - max(0, state.valid[-1] + 1)
        if keep <= 0:
            state.hist_hidden = state.hist_tokens = None
            return
        assert keep <= window.num_rows, "history runs below the window"
        state.hist_hidden = window.hidden[-keep:].clone()
        state.hist_tokens = window.tokens[-keep:].clone()

    def _result(self, upd: SeqUpdate, out: DraftOutput, row: int) -> DraftResult:
        position = upd.start + len(upd.tokens)  # N', the bonus the drafts follow
        if upd.sampling.greedy:
            return DraftResult(upd.seq_id, position, out.tokens[row].cpu())
        return DraftResult(upd.seq_id, position, out.tokens[row].cpu(), out.support[row].cpu(),
                           out.probs[row].float().cpu())


def _signed64(seed: int | None) -> int:
    """A draft seed as int64 (the noise hash takes two's complement); None -> random."""
    if seed is None:
        return int(torch.randint(0, 2 ** 62, ()).item())
    return seed - (1 << 64) if seed >= 1 << 63 else seed

"""The verifier's side of the drafter protocol (DESIGN 3.1, 3.4, 4.8): collecting
drafts, resyncing a drafter that lost a sequence, the update each commit sends, and
the look-ahead entries used on a hit. A mixin of `VerifierEngine` (its state lives
there); one concept per file."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chainspec.engine.draft_types import (
    DraftResult,
    DraftSampling,
    ErrorCode,
    SeqFailure,
    SeqUpdate,
)
from chainspec.engine.prefix_cache import chain_hashes, draft_key
from chainspec.engine.request import Request
from chainspec.engine.schedule import Work, WorkKind
from chainspec.engine.verify_batch import StepResult, VerifyResult
from chainspec.models.attention import DenseCausal

# Steps to wait before retrying to give a sequence drafts after a drafter refused it.
RESYNC_BACKOFF, MAX_RESYNC_BACKOFF = 4, 64


class DraftProtocol:
    """Methods of `VerifierEngine` that talk to its `DraftClient`."""

    def _collect_drafts(self, group: list[Request]) -> None:
        if self.drafter is None:
            return
        by_seq = {self.seq_ids[r.request_id]: r for r in self.running}
        resync: list[SeqUpdate] = []
        wait_for = None if len(group) == len(self.running) else \
            [self.seq_ids[r.request_id] for r in group]
        if self.config.draft_ahead:  # NOTE: a look-ahead hit needs no wait
            wait_for = [self.seq_ids[r.request_id] for r in group if not has_drafts(r)]
        for seq_id, outcome in self.drafter.collect(wait_for).items():
            req = by_seq.get(seq_id)
            if req is None or req.finished:
                continue
            if isinstance(outcome, DraftResult):
                if req.drafts_ahead and has_drafts(req):
                    continue  # the drafter was told it verifies the look-ahead's drafts
                if outcome.position != req.num_computed:
                    req.draft_miss = "stale"
                    continue  # stale: proposed for a round that is over
                req.drafts, req.draft_miss = outcome, None
                req.drafter_synced = True
                req.resync_backoff = RESYNC_BACKOFF
            elif isinstance(outcome, SeqFailure):
                req.drafts, req.drafter_synced = None, False
                if outcome.code == ErrorCode.FAILED_PRECONDITION:
                    req.draft_miss = "resync"
                    resync.append(self._resync_update(req))
                else:  # no drafter could take it now: try again later, backing off
                    req.draft_miss = "no_drafter"
                    req.resync_at = self.steps + req.resync_backoff
                    req.resync_backoff = min(2 * req.resync_backoff, MAX_RESYNC_BACKOFF)
        due = [req for req in self.running if req.resync_at is not None and
               req.resync_at <= self.steps and not req.drafter_synced and
               not req.finished and req.num_computed > 0]
        if due and self._drafter_accepting():  # NOTE: else they stay due: plain decode
            resync += [self._resync_update(req) for req in due]
        self._take_ahead()
        if resync:
            self.drafter.submit(resync)
            for upd in resync:
                # NOTE: the drafter sees the resync before this step's update (same stream,
                # in order), so the sequence may keep sending updates from now on.
                by_seq[upd.seq_id].drafter_synced = True

    def _drafter_accepting(self) -> bool:
        """A resync recomputes the whole prefix: worth it only where a drafter can take
        the sequence (with no drafter, retrying cost a prefill per backoff period).
        A client that cannot tell (`accepting` absent) is always tried."""
        accepting = getattr(self.drafter, "accepting", None)
        return accepting is None or accepting()

    def _drafter_busy(self) -> bool:
        """Whether the drafter still works on a batch sent to it (adaptive depth takes no
        plain sample meanwhile). A client that cannot tell (`busy` absent: the in-process
        one, which answers before `submit` returns) is never busy."""
        busy = getattr(self.drafter, "busy", None)
        return busy is not None and busy()

    def _resync_update(self, req: Request) -> SeqUpdate:
        """Rebuild the drafter's state: recompute h for the committed prefix (DESIGN 3.4)."""
        n = req.num_computed
        self.held.pop(self.seq_ids[req.request_id], None)  # NOTE: the resync covers them
        ids = torch.tensor(req.tokens[:n], device=self.device)
        # NOTE: dense recompute, no KV writes: the target's cache stays as plain decoding
        # built it, so resync cannot change any output token.
        hidden = self.model(ids, torch.arange(n, device=self.device),
                            DenseCausal(1, n, self.model.attention_scale))
        self.resyncs += 1
        req.resync_at = None
        return SeqUpdate(self.seq_ids[req.request_id], 0, tuple(req.tokens[1:n + 1]),
                         hidden.float().cpu(), True, self._draft_sampling(req),
                         cache_keys=self._draft_keys(req, 0, n))

    def _ahead_drafts(self, req: Request, start: int, new: list[int]) -> DraftResult | None:
        """The next round's drafts if a look-ahead for the round at `start` guessed its
        outcome `new` exactly (a hit), else None. Entries are in rank order."""
        ahead, req.ahead = req.ahead, ()
        if not ahead or ahead[0].base != start:
            return None
        rank = next((i for i, e in enumerate(ahead) if e.outcome == tuple(new)), None)
        hit = rank is not None
        self.ahead_hits += hit
        self.ahead_misses += not hit
        self._step_ahead[0 if hit else 1] += 1
        if not hit:
            return None
        self.ahead_rank_hits[rank] = self.ahead_rank_hits.get(rank, 0) + 1
        return ahead[rank].drafts

    def _take_ahead(self) -> None:
        """Keep each sequence's look-ahead for the round it is about to verify."""
        if self.drafter is None or not self.config.draft_ahead:
            return
        entries = self.drafter.ahead()
        if not entries:
            return
        by_seq = {self.seq_ids[r.request_id]: r for r in self.running}
        for seq_id, es in entries.items():
            req = by_seq.get(seq_id)
            if req is not None and not req.finished and es[0].base == req.num_computed:
                req.ahead = es

    def _draft_update(self, item: Work, verdict: VerifyResult | None, result: StepResult,
                      index: int) -> SeqUpdate | None:
        """Rows the drafter needs: (h_p, x[p+1]) for the rows this step committed."""
        req = item.request
        if self.drafter is None or req.finished:
            return None
        if item.kind is WorkKind.VERIFY and not req.drafter_synced:
            return None  # a resync is under way or the drafter is gone: plain decode
        rows = item.num_rows if item.kind is WorkKind.PREFILL else verdict.accepted + 1
        hidden = result.hidden_rows(index, rows)
        tokens = tuple(req.tokens[item.start + 1: item.start + 1 + rows])
        opens = item.kind is WorkKind.PREFILL and item.start == req.prefix_hit
        if opens:  # NOTE: past 0 on a prefix hit: the drafter reads the rest from its cache
            req.drafter_synced = True
        ahead = self.config.draft_ahead and verdict is not None
        verifying = tuple(req.drafts.tokens.tolist()) if ahead and req.drafts_ahead else ()
        # NOTE: the chunk that ends a recompute (after preemption) commits nothing, but
        # drafts for x[N] may follow it.
        wants = (verdict is not None or item.start + rows == req.recompute_len) and \
            req.wants_drafts
        start = item.start
        if (item.kind is WorkKind.VERIFY or not req.wants_drafts) and not ahead:
            held = self._hold(req, start, tokens, hidden, wants)
            if held is None:
                return None
            start, tokens, hidden = held
        depth = 0 if ahead else self._depth_asked(req)
        # NOTE: the update that opens the sequence (its rows held or not) starts at the
        # prefix hit, and names every cached block below it (the drafter reads them)
        keys = self._draft_keys(req, start, item.start + rows, start == req.prefix_hit,
                                noted=req.max_drafts >= self.config.num_steps)
        return SeqUpdate(self.seq_ids[req.request_id], start, tokens, hidden,
                         want_drafts=wants, sampling=self._draft_sampling(req),
                         look_ahead=ahead, verifying=verifying, cache_keys=keys,
                         num_drafts=depth)

    def _depth_asked(self, req: Request) -> int:
        """Drafter-side depth (4.11): the draft steps the next round needs for `req`, 0
        for all K: its cap, and under adaptive depth the policy's `ask`. NOTE: the round
        runs its deepest update's steps; look-aheads (4.8) always ask for K."""
        k = self.config.num_steps
        policy = self.depth.ask if self.depth is not None else 0
        ask = min(policy or k, req.max_drafts)
        return 0 if ask >= k else max(1, ask)

    def _hold(self, req: Request, start: int, tokens: tuple[int, ...], hidden: torch.Tensor,
              wants: bool) -> tuple[int, tuple[int, ...], torch.Tensor] | None:
        """Adaptive depth (4.11): the rows of a sequence that asks for no drafts wait here
        and go with its next update that asks for some, so a step where no sequence
        drafts runs no draft round at all (the drafter continues from `start` as ever).
        None: nothing to send now. A request capped at 0 never drafts: its drafter state
        is released instead."""
        seq_id = self.seq_ids[req.request_id]
        if req.max_drafts == 0:
            self._release_drafter(req)
            req.drafter_synced = False  # NOTE: no resync is scheduled: none is ever needed
            return None
        held = self.held.get(seq_id)
        if held is None:
            held = self.held[seq_id] = HeldRows(start)
        held.tokens.extend(tokens)
        held.hidden.append(hidden.clone())  # NOTE: a view of the step's output buffer
        if not wants:
            return None
        del self.held[seq_id]
        return held.start, tuple(held.tokens), torch.cat(held.hidden)  # [rows, H]

    def _release_drafter(self, req: Request) -> None:
        """The drafter forgets the sequence; rows held for it go too."""
        seq_id = self.seq_ids[req.request_id]
        self.held.pop(seq_id, None)
        self.drafter.release([seq_id])

    def _draft_keys(self, req: Request, start: int, end: int, opens: bool = True,
                    noted: bool = True) -> tuple[tuple[int, bytes], ...]:
        """Drafter keys (prefix_cache.draft_key) of the blocks an update from `start` to
        `end` makes final (the drafter's KV at p <= end - K is: K tokens after each), and,
        on an update that `opens` the sequence, of every block below `start` too.
        `noted`: the drafter will cache them, so they are noted in our cache
        (`PrefixCache.note_after`) for admission. Not for a request capped below K: its
        rounds never run every step, so its blocks wait in the drafter for a lagging
        step that only a long lag forces (drafter.py `_round_depth`). NOTE: an uncapped
        sequence that ends while a step lags (adaptive depth asked fewer) leaves noted
        blocks the drafter never cached: a later hit on them resyncs."""
        if self.allocator.cache is None:
            return ()
        bs, k = self.allocator.block_size, self.config.num_steps
        first = 0 if opens else max(0, start - k + 1) // bs
        last = max(max(0, end - k + 1) // bs, start // bs if opens else 0)
        if last <= first:
            return ()
        hashes = chain_hashes(req.tokens, bs, req.block_hashes, last, req.hash_root)
        keys = []
        for i in range(first, last):
            following = tuple(req.tokens[(i + 1) * bs:(i + 1) * bs + k])
            keys.append(((i + 1) * bs, draft_key(hashes[i], following)))
            block = self.allocator.cache.lookup(hashes[i]) if noted else None
            if block is not None and len(following) == k:
                # NOTE: the drafter caches it under this key: admission reads it
                self.allocator.cache.note_after(block, following)
        return tuple(keys)

    def _draft_sampling(self, req: Request) -> DraftSampling:
        s = req.sampling
        if s.greedy or not self.config.sampled_drafts:
            return DraftSampling(0.0, 0, s.seed)
        return DraftSampling(s.temperature, self.config.draft_top_k, s.seed)


@dataclass
class HeldRows:
    """A sequence's rows waiting for its next update that asks for drafts (`_hold`):
    kept in pieces, joined once when they go (a plain spell adds a row a step)."""

    start: int
    tokens: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # [rows, H] pieces


def has_drafts(req: Request) -> bool:
    """Drafts are in hand for the round the sequence verifies next."""
    return req.drafts is not None and req.drafts.position == req.num_computed

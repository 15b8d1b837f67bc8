"""The drafter's side of draft-ahead (DESIGN 4.8; the scheme and its exactness argument
are in lookahead.py): which look-aheads run, their rounds on copy-on-write scratch
blocks, and the early look-ahead on a hit, whose first round rides in the hit's own
exact round (a round's cost is mostly fixed: one batch instead of two). A mixin of
`DrafterEngine` (its state lives there); one concept per file."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from chainspec.engine.draft_batch import Window
from chainspec.engine.draft_step import DraftOutput
from chainspec.engine.draft_types import DraftAhead, SeqUpdate
from chainspec.engine.lookahead import (
    AheadSource,
    Hypothesis,
    ahead_entry,
    bonus_entry,
    bonus_rows,
    corrections,
    full_accepts,
    history_window,
    hypothesis_window,
    ranked,
    select,
)


class DraftAheadRounds:
    """Methods of `DrafterEngine` that propose look-ahead entries."""

    def pending_ahead(self) -> list[AheadSource]:
        """The look-aheads the last `update` asked for (and forget them)."""
        todo, self._ahead = self._ahead, []
        return todo

    @torch.inference_mode()
    def look_ahead(self, todo: list[AheadSource] | None = None) -> list[DraftAhead]:
        """Draft-ahead entries (lookahead.py) for `todo`, by default those the last
        `update` asked for; call after answering that update. Sources whose sequence
        moved on or left since are skipped. Changes no sequence state: every window runs
        on scratch blocks (copy-on-write), freed before returning. `ahead_plan` holds
        the hypotheses behind the entries, in the same order (best first per sequence).

        Round 1: the bonus pass and the corrections (a < m); round 2: the full-K drafts
        of the top bonus guesses (a = m); both as far as they fit in the verifier's step
        (`AheadClock`), none if not even the bonus pass does. Without round 2, the bonus
        pass's own row stands for a = m (K-1 drafts)."""
        todo = self.pending_ahead() if todo is None else todo
        todo = [src for src in todo if self._current(src)]
        self.ahead_plan = []
        if not todo or self.cache.has_states:  # NOTE: scratch copies paged KV only
            return []
        first = self._first_windows(todo, timed=True)
        if first is None:
            return []
        ran = self._run_scratch(first.windows, first.seq_ids)
        if ran is None:
            return []
        return self._second_round(*self._first_entries(first, ran[0], 0))

    @torch.inference_mode()
    def look_ahead_early(self, first: _FirstRound | None) -> list[DraftAhead]:
        """The look-ahead entries of an update's hits (updates that verify the drafts of
        an entry this drafter proposed), whose first round rode in that update's own
        draft round (`pending_early`): the second round, as far as it fits. Call after
        answering the update. Changes no sequence state."""
        self.ahead_plan = []
        if first is None or not all(self._current(src) for src in first.todo):
            return []  # NOTE: one of its sequences moved on or left meanwhile
        return self._second_round(*first.done)

    def pending_early(self) -> _FirstRound | None:
        """The first look-ahead round the last `update` drafted for its hits (and
        forget it)."""
        first, self._first = self._first, None
        return first

    def _current(self, src: AheadSource) -> bool:
        K, c = self.config.num_steps, self.config
        return src.seq_id in self.seqs and self._base(src.seq_id) == src.base and \
            src.base + src.verify.shape[0] + 1 + K <= c.max_len

    def _second_round(self, plan: list[Hypothesis], entries: list[DraftAhead],
                      finals: list[Hypothesis]) -> list[DraftAhead]:
        """Round 2 over `finals` (a = m, and corrections round 1 left), as far as they
        fit; every entry, grouped by sequence, likeliest first (`ahead_plan` beside
        them)."""
        c = self.config
        if c.ahead_second_round is None and self.ahead_clock is not None:  # as fit
            left = self.ahead_clock.rows_left(time.perf_counter())
            finals = finals if left is None else _within(finals, left, self._hist_rows)
        if finals and c.ahead_second_round is not False:
            second = self.draft_hypotheses(finals)  # NOTE: [] if the pool is short
            done = {(e.seq_id, e.outcome) for e in second}
            keep = [i for i, e in enumerate(entries) if (e.seq_id, e.outcome) not in done]
            plan = [plan[i] for i in keep] + (finals if second else [])
            entries = [entries[i] for i in keep] + second
        order = sorted(range(len(plan)), key=lambda i: (plan[i].src.seq_id, -plan[i].prob))
        self.ahead_plan = ranked([plan[i] for i in order])
        return [entries[i] for i in order]

    def _first_windows(self, todo: list[AheadSource], timed: bool) -> _FirstRound | None:
        """Round 1's windows: each source's bonus pass, then the corrections that fit;
        None when `timed` and not even the bonus passes fit in the verifier's step."""
        c = self.config
        seqs = {src.seq_id for src in todo}
        self._chained = {key: s for key, s in self._chained.items() if key[0] not in seqs}
        lengths = {src.seq_id: self.accept_rates.lengths(src.verify.shape[0])
                   for src in todo}
        fixes = [h for src in todo
                 for h in corrections(src, self._step_logits(src), c.ahead_fanout,
                                      lengths[src.seq_id])]
        windows = []
        for src in todo:
            hidden, tokens = bonus_rows(src)
            windows.append(history_window((), src.base, hidden, tokens,
                                          *self._history(src.seq_id), src))
        hist = {src.seq_id: windows[i].num_rows - src.verify.shape[0]
                for i, src in enumerate(todo)}
        spent = sum(w.num_rows for w in windows)
        covered = {src.seq_id: lengths[src.seq_id][-1] / 2 for src in todo}
        budget = c.ahead_rows
        if timed and c.ahead_second_round is None and self.ahead_clock is not None:
            left = self.ahead_clock.rows_left(time.perf_counter())
            if left is not None and left < spent:
                return None  # NOTE: too late for this verdict: keep the drafter free
            budget = budget if left is None else min(budget, left)
        chosen = select(fixes, budget, hist, covered, spent)
        picked = {(h.src.seq_id, h.outcome) for h in chosen}
        rest = [h for h in fixes if (h.src.seq_id, h.outcome) not in picked]
        windows += [self._hypothesis_window(h) for h in chosen]
        return _FirstRound(todo, windows, [src.seq_id for src in todo] +
                           [h.src.seq_id for h in chosen], chosen, lengths, hist, rest)

    def _step_logits(self, src: AheadSource) -> torch.Tensor:
        """[m, V]: the drafter's distributions for x[N'+1..N'+m] (its steps at N'-1)."""
        m = src.verify.shape[0]
        return torch.cat([self.model.logits(k + 1 + src.step0, src.chain[k:k + 1])
                          for k in range(m)])

    def _first_entries(self, first: _FirstRound, out: DraftOutput, offset: int):
        """Round 1's (hypotheses, entries, the hypotheses for round 2: a = m, and the
        corrections round 1 left), from its windows' rows of `out` (from row `offset`
        on)."""
        c, todo, lengths = self.config, first.todo, first.lengths
        self._hist_rows = first.hist
        S = len(todo)
        bonus = self.model.logits(1, out.chain[offset:offset + S, 0])  # [S, V]: x[N'+m+1]
        plan, entries, finals = [], [], []
        for row, src in enumerate(todo):
            entry = bonus_entry(src, out, offset + row, src.temperature > 0)
            d = entry.drafts  # NOTE: kept like a full-K entry's, for its hit's look-ahead
            self._chained[(d.seq_id, d.position, tuple(d.tokens.tolist()))] = AheadSource(
                d.seq_id, d.position, d.tokens, out.chain[offset + row, 1:].clone(),
                src.temperature, src.seed, step0=1)
            p_b = float(bonus[row].float().softmax(-1)[entry.outcome[-1]])
            plan.append(Hypothesis(src, entry.outcome, src.chain[:src.verify.shape[0]],
                                   lengths[src.seq_id][-1] * p_b))
            entries.append(entry)
            finals += full_accepts(src, bonus[row], out.chain[offset + row, 0],
                                   c.ahead_fanout, lengths[src.seq_id][-1])
        plan += first.fixes
        entries += [self._chain_entry(h, out, offset + S + i)
                    for i, h in enumerate(first.fixes)]
        return plan, entries, select(finals + first.rest, c.ahead_rows, first.hist,
                                     {s: 0.0 for s in first.hist})

    def _hypothesis_window(self, h: Hypothesis) -> Window:
        return hypothesis_window(h, (), *self._history(h.src.seq_id))

    def _history(self, seq_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows a look-ahead window starts with: the history rows, and on an early
        look-ahead's first round (`_early_sources`) the rows its update brings after
        them."""
        if seq_id in self._early:
            return self._early[seq_id][:2]
        st = self.seqs[seq_id]
        return st.hist_hidden, st.hist_tokens

    def _base(self, seq_id: int) -> int:
        """The bonus index a look-ahead for `seq_id` must start from."""
        return self._early[seq_id][2] if seq_id in self._early else \
            self.seqs[seq_id].next_start

    def _early_sources(self, updates: list[SeqUpdate]) -> list[AheadSource]:
        """The look-ahead sources of the updates that verify the drafts of an entry this
        drafter proposed (hits), taken before those updates commit: the chain states
        that entry's round left at its last row, the update's rows (true h) extending
        the history (`_history`, `_base`)."""
        todo = []
        for u in updates:
            src = self._hit_source(u)
            if src is None:
                continue
            st = self.seqs[u.seq_id]
            hidden = torch.cat([st.hist_hidden, u.hidden.to(self.dtype)])
            tokens = torch.cat([st.hist_tokens, torch.tensor(u.tokens, dtype=torch.int64)])
            self._early[u.seq_id] = (hidden, tokens, u.end)
            todo.append(src)
        return todo

    def split_hits(self, updates: Sequence[SeqUpdate]) -> tuple[list[int], list[int]]:
        """Indices of `updates` to answer first (the verifier waits for their drafts)
        and of the hits to answer after them, when there are both: the answer it waits
        for then comes from a round over the misses alone, and the hits' exact windows
        ride in the next round with every look-ahead's first round (`update`'s
        `rest_of`). Else every index first, none after."""
        hits = [i for i, u in enumerate(updates) if self._hit_source(u) is not None]
        first = [i for i in range(len(updates)) if i not in set(hits)]
        waits = any(updates[i].want_drafts for i in first)
        if not hits or not waits or self.cache.has_states or self.config.num_steps < 2:
            return list(range(len(updates))), []
        return first, hits

    def _hit_source(self, u: SeqUpdate) -> AheadSource | None:
        """The chain states of the entry `u` verifies, if `u` is a hit that asks for a
        look-ahead."""
        st = self.seqs.get(u.seq_id)
        src = self._chained.get((u.seq_id, u.end, u.verifying))
        if src is None or st is None or not u.look_ahead or not u.want_drafts or \
                u.start != st.next_start or st.hist_hidden is None:
            return None
        return src

    def _run_with_early(self, updates: list[SeqUpdate], windows: list[Window],
                        rest_of: list[AheadSource], depth: int | None = None
                        ) -> tuple[DraftOutput, str | None, dict[int, AheadSource], bool]:
        """The exact round over `windows` (of `updates`). When every update that asks for
        a look-ahead is a hit, their first look-ahead round runs in the same batch (rows
        after the exact ones; `pending_early`): it costs no round of its own, and the
        verifier waits for no answer. Else the answer comes first (the verifier waits
        for it) and the hits' look-aheads follow it with the others'. NOTE: exact
        windows write the real blocks at rows from their first row on; a scratch window
        of the same sequence starts at that same row and reads only below it (a block
        copied before the round): they never meet. Returns the output, why it ran
        eagerly, the hits' sources by sequence, and whether their first round ran. `depth`:
        the exact round's draft steps (K whenever a look-ahead is asked for)."""
        self._first = None
        asking = sum(u.look_ahead and u.want_drafts for u in updates)
        todo = [] if self.cache.has_states or self.config.num_steps < 2 else \
            self._early_sources(updates)
        hits = {src.seq_id: src for src in todo}
        rest_of = [src for src in rest_of if self._current(src) and src.seq_id not in hits]
        try:
            if todo and len(todo) == asking:
                # NOTE: the first part's look-aheads start from committed state (history
                # rows only); the hits' from the true rows of their updates (_early)
                first = self._first_windows(todo + rest_of, timed=False)
                ran = self._run_scratch(first.windows, first.seq_ids, exact=windows)
                if ran is not None:
                    first.done = self._first_entries(first, ran[0], len(windows))
                    self._first = first
                    return *ran, hits, True
        finally:
            self._early = {}
        self._ahead += rest_of  # NOTE: did not ride: they run after this answer
        return *self._run(windows, depth), hits, False

    @torch.inference_mode()
    def draft_hypotheses(self, hyps: list[Hypothesis]) -> list[DraftAhead]:
        """One draft round over the hypotheses' windows: their entries, in hyps' order."""
        hyps = [h for h in hyps if h.src.seq_id in self.seqs and
                self._base(h.src.seq_id) == h.src.base]
        if not hyps:
            return []
        ran = self._run_scratch([self._hypothesis_window(h) for h in hyps],
                                [h.src.seq_id for h in hyps])
        if ran is None:
            return []
        return [self._chain_entry(h, ran[0], row) for row, h in enumerate(hyps)]

    def _chain_entry(self, h: Hypothesis, out: DraftOutput, row: int) -> DraftAhead:
        """A full-K entry, its chain states kept for an early look-ahead on its hit."""
        entry = ahead_entry(h, out, row, h.src.temperature > 0)
        d = entry.drafts
        self._chained[(d.seq_id, d.position, tuple(d.tokens.tolist()))] = AheadSource(
            d.seq_id, d.position, d.tokens, out.chain[row].clone(), h.src.temperature,
            h.src.seed)
        return entry

    def _run_scratch(self, windows: list[Window], seq_ids: list[int],
                     exact: list[Window] = ()) -> tuple[DraftOutput, str | None] | None:
        """Run `windows` (their blocks unset) of `seq_ids` on scratch blocks, after the
        `exact` windows (real blocks) in one batch: the output and why it ran eagerly
        (`_run`). None when the pool cannot hold them (a look-ahead is only a guess),
        and then nothing ran."""
        held: list[int] = []
        ready = list(exact)
        for w, seq_id in zip(windows, seq_ids, strict=True):
            blocks = self._scratch(seq_id, w)
            if blocks is None:
                self.allocator.free(held)
                return None
            held += blocks[w.first_pos // self.allocator.block_size:]
            ready.append(replace(w, blocks=tuple(blocks)))
        if not exact:
            self._clock = None  # NOTE: the observer times exact rounds only
        started = time.perf_counter()
        try:
            out, eager_reason = self._run(ready)
        finally:
            self.allocator.free(held)
        self.ahead_rounds += 1
        if self.ahead_clock is not None and not exact:
            self.ahead_clock.round_done(sum(w.num_rows for w in ready),
                                        time.perf_counter() - started)
        return out, eager_reason

    def _scratch(self, seq_id: int, w: Window) -> list[int] | None:
        """A copy-on-write table for `w`: the sequence's blocks below the one holding
        w's first row, then a copy of that block and fresh ones up to w's last row."""
        real, bs = self.seqs[seq_id].blocks.blocks, self.allocator.block_size
        lo = w.first_pos // bs
        got = self.allocator.allocate(self.allocator.blocks_for(w.first_pos + w.num_rows)
                                      - lo)
        if got is None:
            return None
        if lo < len(real) and w.first_pos > lo * bs:  # rows below first_pos are read
            for t in self.cache.keys + self.cache.values:  # [blocks, bs, Hkv, D]
                t[got[0]] = t[real[lo]]
        return real[:lo] + got

    def _ahead_source(self, upd: SeqUpdate, window: Window, out: DraftOutput,
                      row: int) -> AheadSource:
        verify = torch.tensor(upd.verifying, dtype=torch.int64) if upd.verifying \
            else out.tokens[row].cpu()
        self.seqs[upd.seq_id].verifying = verify.shape[0]
        return AheadSource(upd.seq_id, upd.end, verify, out.chain[row],
                           window.temperature, window.seed)


@dataclass(eq=False)
class _FirstRound:
    """A first look-ahead round: its sources, windows (bonus passes, then corrections)
    and their sequences, the corrections, P(a) per sequence, history rows per sequence,
    the corrections left for round 2, and once it ran, its (hypotheses, entries, the
    hypotheses for round 2)."""

    todo: list[AheadSource]
    windows: list[Window]
    seq_ids: list[int]
    fixes: list[Hypothesis]
    lengths: dict[int, list[float]]
    hist: dict[int, int]
    rest: list[Hypothesis]
    done: tuple | None = None


def _within(hyps: list[Hypothesis], rows: int, hist_rows: dict[int, int]) -> list[Hypothesis]:
    """The hypotheses whose windows fit in `rows`: every sequence's best first."""
    out = []
    for h in sorted(hyps, key=lambda h: (h.rank, -h.prob)):
        rows -= hist_rows[h.src.seq_id] + len(h.outcome)
        if rows < 0:
            break
        out.append(h)
    return out

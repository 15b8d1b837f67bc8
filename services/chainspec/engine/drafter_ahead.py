"""The drafter's side of draft-ahead (DESIGN 4.8; the scheme and its exactness argument
are in lookahead.py): which look-aheads run, their rounds on copy-on-write scratch
blocks, and the early look-ahead on a hit. A mixin of `DrafterEngine` (its state lives
there); one concept per file."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

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
        K, c = self.config.num_steps, self.config
        todo = [src for src in todo if src.seq_id in self.seqs and
                self._base(src.seq_id) == src.base and
                src.base + src.verify.shape[0] + 1 + K <= c.max_len]
        self.ahead_plan = []
        if not todo or self.cache.has_states:  # NOTE: scratch copies paged KV only
            return []
        seqs = {src.seq_id for src in todo}
        self._chained = {key: s for key, s in self._chained.items() if key[0] not in seqs}
        first = self._first_round(todo)
        if first is None:
            return []
        plan, entries, finals = first
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

    def _first_round(self, todo: list[AheadSource]):
        """Round 1: (its hypotheses, their entries, the a = m hypotheses for round 2)."""
        K, c = self.config.num_steps, self.config
        chains = torch.stack([src.chain for src in todo])  # [S, K, H]: g[k] at row N'-1
        step_logits = torch.stack([self.model.logits(k + 1, chains[:, k])
                                   for k in range(K)], 1)  # [S, K, V]
        lengths = {src.seq_id: self.accept_rates.lengths(src.verify.shape[0])
                   for src in todo}
        fixes = [h for row, src in enumerate(todo)
                 for h in corrections(src, step_logits[row], c.ahead_fanout,
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
        if c.ahead_second_round is None and self.ahead_clock is not None:  # as time allows
            left = self.ahead_clock.rows_left(time.perf_counter())
            if left is not None and left < spent:
                return None  # NOTE: too late for this verdict: keep the drafter free
            budget = budget if left is None else min(budget, left)
        fixes = select(fixes, budget, hist, covered, spent)
        windows += [self._hypothesis_window(h) for h in fixes]
        out = self._run_scratch(windows, [src.seq_id for src in todo] +
                                [h.src.seq_id for h in fixes])
        if out is None:
            return None
        self._hist_rows = hist
        S = len(todo)
        bonus = self.model.logits(1, out.chain[:S, 0])  # [S, V]: x[N'+m+1]
        plan, entries, finals = [], [], []
        for row, src in enumerate(todo):
            entry = bonus_entry(src, out, row, src.temperature > 0)
            p_b = float(bonus[row].float().softmax(-1)[entry.outcome[-1]])
            plan.append(Hypothesis(src, entry.outcome, src.chain[:src.verify.shape[0]],
                                   lengths[src.seq_id][-1] * p_b))
            entries.append(entry)
            finals += full_accepts(src, bonus[row], out.chain[row, 0], c.ahead_fanout,
                                   lengths[src.seq_id][-1])
        plan += fixes
        entries += [self._chain_entry(h, out, S + i) for i, h in enumerate(fixes)]
        return plan, entries, select(finals, c.ahead_rows, hist, {s: 0.0 for s in hist})

    def _hypothesis_window(self, h: Hypothesis) -> Window:
        return hypothesis_window(h, (), *self._history(h.src.seq_id))

    def _history(self, seq_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows a look-ahead window starts with: the history rows, and on an early
        look-ahead (`look_ahead_early`) the rows its update brings after them."""
        if seq_id in self._early:
            return self._early[seq_id][:2]
        st = self.seqs[seq_id]
        return st.hist_hidden, st.hist_tokens

    def _base(self, seq_id: int) -> int:
        """The bonus index a look-ahead for `seq_id` must start from."""
        return self._early[seq_id][2] if seq_id in self._early else \
            self.seqs[seq_id].next_start

    @torch.inference_mode()
    def look_ahead_early(self, updates: Sequence[SeqUpdate]) -> list[DraftAhead]:
        """Look-aheads for updates that verify the drafts of an entry this drafter
        proposed (a hit), before those updates run: from the chain states that entry's
        own round left at its last row, the update's rows (true h) extending the
        history. Their entries are on the wire one exact round earlier, inside the
        verifier's forward; the updates then ask for no look-ahead of their own.
        Changes no sequence state."""
        todo = []
        for u in updates:
            st = self.seqs.get(u.seq_id)
            src = self._chained.get((u.seq_id, u.end, u.verifying))
            if src is None or st is None or not u.look_ahead or not u.want_drafts or \
                    u.start != st.next_start or st.hist_hidden is None:
                continue
            hidden = torch.cat([st.hist_hidden, u.hidden.to(self.dtype)])
            tokens = torch.cat([st.hist_tokens, torch.tensor(u.tokens, dtype=torch.int64)])
            self._early[u.seq_id] = (hidden, tokens, u.end)
            todo.append(src)
        try:
            entries = self.look_ahead(todo) if todo else []
        finally:
            self._early_done = set(self._early)
            self._early = {}
        return entries

    @torch.inference_mode()
    def draft_hypotheses(self, hyps: list[Hypothesis]) -> list[DraftAhead]:
        """One draft round over the hypotheses' windows: their entries, in hyps' order."""
        hyps = [h for h in hyps if h.src.seq_id in self.seqs and
                self._base(h.src.seq_id) == h.src.base]
        if not hyps:
            return []
        out = self._run_scratch([self._hypothesis_window(h) for h in hyps],
                                [h.src.seq_id for h in hyps])
        if out is None:
            return []
        return [self._chain_entry(h, out, row) for row, h in enumerate(hyps)]

    def _chain_entry(self, h: Hypothesis, out: DraftOutput, row: int) -> DraftAhead:
        """A full-K entry, its chain states kept for an early look-ahead on its hit."""
        entry = ahead_entry(h, out, row, h.src.temperature > 0)
        d = entry.drafts
        self._chained[(d.seq_id, d.position, tuple(d.tokens.tolist()))] = AheadSource(
            d.seq_id, d.position, d.tokens, out.chain[row].clone(), h.src.temperature,
            h.src.seed)
        return entry

    def _run_scratch(self, windows: list[Window], seq_ids: list[int]) -> DraftOutput | None:
        """Run `windows` (their blocks unset) of `seq_ids` on scratch blocks; None when
        the pool cannot hold them (a look-ahead is only a guess)."""
        held: list[int] = []
        ready = []
        for w, seq_id in zip(windows, seq_ids, strict=True):
            blocks = self._scratch(seq_id, w)
            if blocks is None:
                self.allocator.free(held)
                return None
            held += blocks[w.first_pos // self.allocator.block_size:]
            ready.append(replace(w, blocks=tuple(blocks)))
        self._clock = None  # NOTE: the observer times exact rounds only
        started = time.perf_counter()
        try:
            out, _ = self._run(ready)
        finally:
            self.allocator.free(held)
        self.ahead_rounds += 1
        if self.ahead_clock is not None:
            self.ahead_clock.round_done(sum(w.num_rows for w in ready),
                                        time.perf_counter() - started)
        return out

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


def _within(hyps: list[Hypothesis], rows: int, hist_rows: dict[int, int]) -> list[Hypothesis]:
    """The hypotheses whose windows fit in `rows`: every sequence's best first."""
    out = []
    for h in sorted(hyps, key=lambda h: (h.rank, -h.prob)):
        rows -= hist_rows[h.src.seq_id] + len(h.outcome)
        if rows < 0:
            break
        out.append(h)
    return out

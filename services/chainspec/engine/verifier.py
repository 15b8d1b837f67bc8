"""The verifier engine: continuous batching over slots, one target forward per step,
batched acceptance, commit and stop conditions (DESIGN 3, 4.2); the drafter protocol's
half is `engine/verifier_drafts.py`.

One `step()`:
  collect drafts -> admit -> schedule -> forward -> accept -> commit -> send updates

Pipelined groups (`VerifierConfig.groups` > 1, DESIGN 4.8): running sequences are split
into groups that take turns, one group per step. A step waits only for its own group's
drafts, and its updates leave as soon as its verdicts exist, so a remote drafter
computes one group's drafts while the verifier runs another group's forward. Every
sequence's own rounds are unchanged (same windows, same acceptance), so output is too.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from chainspec.engine import preemption
from chainspec.engine.adaptive_depth import AdaptiveDepth
from chainspec.engine.admission import (
    OWN_PARTY,
    Admission,
    SchedulingPolicy,
    check_priority,
    fair_victim,
    next_admission,
)
from chainspec.engine.detokenizer import stop_tail
from chainspec.engine.draft_client import DraftClient
from chainspec.engine.draft_types import (
    SeqUpdate,
)
from chainspec.engine.grammar import start_grammar
from chainspec.engine.grammar_mask import guide_drafts
from chainspec.engine.kv_budget import KVBudget, model_cache
from chainspec.engine.observer import VerifierObserver, VerifierStepRecord
from chainspec.engine.prefix_cache import salt_root
from chainspec.engine.request import FinishReason, Request, RequestOutput, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.schedule import Work, WorkKind, schedule
from chainspec.engine.verifier_drafts import DraftProtocol, HeldRows
from chainspec.engine.verify_batch import VerifyResult, run_verify
from chainspec.engine.verify_graphs import VerifyGraphs
from chainspec.models.target import TargetModel
from chainspec.spine.sections import StackSection
from chainspec.spine.sections import default as spine_default


@dataclass(frozen=True)
class VerifierConfig:
    # NOTE: the spine's defaults (engine/factory.py sets every one from LocalOptions)
    num_steps: int = spine_default(StackSection, "num_speculative_tokens")  # K
    # cap on running sequences (KV memory is `kv`'s business)
    max_seqs: int = spine_default(StackSection, "max_num_seqs")
    max_len: int = spine_default(StackSection, "max_model_len")  # context of a sequence
    max_batch_tokens: int = 1024
    prefill_chunk: int = 512
    sampled_drafts: bool = True  # sampled requests get top-k sampled drafts, else greedy
    draft_top_k: int = spine_default(StackSection, "draft_top_k")  # asked of sampled drafts
    groups: int = 1  # pipelined groups taking turns (1: every running sequence each step)
    draft_ahead: bool = False  # ask for look-ahead drafts and use them on a hit (4.8)
    kv: KVBudget = field(default_factory=KVBudget)  # paged KV cache size
    use_graphs: bool = not spine_default(StackSection, "enforce_eager")  # CUDA graphs (GPU)
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS  # admission order
    adaptive_depth: bool = False  # choose k in 0..K per sequence each step (DESIGN 4.11)
    seed: int | None = spine_default(StackSection, "seed")  # of unseeded requests' seeds

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        if self.num_steps < 1:
            raise ValueError(f"num_steps (K) must be >= 1, got {self.num_steps}")
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.max_seqs < 1 or self.prefill_chunk < 1:
            raise ValueError("max_seqs and prefill_chunk must be >= 1")
        if self.max_batch_tokens < self.max_seqs * (self.num_steps + 1):
            raise ValueError("max_batch_tokens must hold a verify window for every slot")


class VerifierEngine(DraftProtocol):
    def __init__(self, model: TargetModel, config: VerifierConfig,
                 drafter: DraftClient | None = None, eos_ids: Sequence[int] = (),
                 detokenize: Callable[[list[int]], str] | None = None,
                 observer: VerifierObserver | None = None) -> None:
        self.model = model.eval()
        self.config = config
        self.drafter = drafter
        self.eos_ids = frozenset(eos_ids)
        self.detokenize = detokenize
        self.observer = observer  # metrics: told about requests and steps (host values only)
        self.draws = random.Random(config.seed) if config.seed is not None else None
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache, self.allocator, self.claims = model_cache(
            model.cache_specs(), config.kv, config.max_seqs, config.max_len,
            max(config.prefill_chunk, config.num_steps + 1), config.num_steps + 1,
            self.dtype, self.device,
            # NOTE: not on a TP group: snapshots are copied on this rank's states alone
            snapshot_states=getattr(model, "tp", None) is None)
        self.preemptions = 0
        self.graphs = VerifyGraphs(model, self.cache, config.max_seqs, config.num_steps,
                                   config.max_len, config.use_graphs)
        self.graphs.capture()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.seq_ids: dict[str, int] = {}
        self._next_seq_id = 0
        self.resyncs = 0
        self.steps = 0
        self.ahead_hits = self.ahead_misses = 0  # look-ahead outcomes (cumulative)
        self.ahead_rank_hits: dict[int, int] = {}  # hits by the matching entry's rank
        self._step_ahead = [0, 0]  # this step's hits, misses (for the observer)
        self._turn = 0  # the group whose step is next
        self.depth = AdaptiveDepth(config.num_steps) if config.adaptive_depth else None
        self.held: dict[int, HeldRows] = {}  # rows waiting for a round with drafts (_hold)

    # -- requests -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams,
                    stop: StopConditions, arrival_s: float | None = None,
                    admission: Admission = OWN_PARTY,
                    num_speculative_tokens: int | None = None,
                    generated: Sequence[int] = (), cache_salt: str | None = None) -> None:
        """Queue a request. Raises ValueError for input the model cannot take.
        `arrival_s`: when it reached the server (`time.perf_counter()`; default now).
        `admission`: its priority and party (engine/admission.py).
        `num_speculative_tokens`: the request's cap on drafts per round (0: none; None or
        more than K: K). `generated`: output it already has (a continuation of a request
        another verifier lost): it is admitted as if preempted here, so its stop
        conditions count those tokens and seeded noise keys stay absolute positions.
        `cache_salt` (vLLM's): shares cached prefix blocks only with the same salt."""
        if num_speculative_tokens is not None and num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if request_id in self.by_id:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_priority(admission.priority, self.config.scheduling_policy)
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in sampling.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        need = len(prompt) + stop.max_tokens + self.config.num_steps + 1
        if need > self.config.max_len:
            limit = self.config.max_len - 1 - self.config.num_steps
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({stop.max_tokens}) "
                             f"exceeds the context limit {limit}")
        if self.allocator.blocks_for(need) > self.allocator.num_blocks:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({stop.max_tokens}) "
                             f"exceeds the KV cache ({self.allocator.num_blocks} blocks of "
                             f"{self.allocator.block_size})")
        if any(not 0 <= t < vocab for t in generated):
            raise ValueError(f"generated token ids must be in [0, {vocab})")
        req = Request(request_id, list(prompt), sampling.resolve_seed(self.draws), stop,
                      self.config.num_steps)
        if generated:
            self._continue(req, generated)
        if sampling.grammar is not None:  # NOTE: after _continue: it follows that output too
            req.grammar = start_grammar(sampling.grammar, req.output_tokens, stop, vocab)
        req.claims = self.claims.new()
        req.hash_root = salt_root(cache_salt) if cache_salt else None  # prefix caching
        req.party, req.priority = admission.party or request_id, admission.priority
        req.seeded = sampling.seed is not None
        if num_speculative_tokens is not None:
            req.max_drafts = min(num_speculative_tokens, self.config.num_steps)
            req.wants_drafts = req.max_drafts > 0
            req.draft_miss = None if req.wants_drafts else "depth"
        self.by_id[request_id] = req
        self.seq_ids[request_id] = self._next_seq_id
        self._next_seq_id += 1
        self.waiting.append(req)
        if self.observer is not None:
            self.observer.request_added(request_id, len(prompt),
                                        time.perf_counter() if arrival_s is None else arrival_s)

    def _continue(self, req: Request, generated: Sequence[int]) -> None:
        """Give a new request the output it already has: a preempted request's state
        (recompute the committed prefix, then verify the newest token), finished at once
        when that output already meets a stop condition."""
        req.tokens.extend(generated)
        preemption.requeue(req)
        req.preemptions = 0
        req.finish_reason = self._stop_reason(req, req.tokens[-1])

    def abort(self, request_id: str) -> bool:
        req = self.by_id.get(request_id)
        if req is None or req.finished:
            return False
        req.finish_reason = FinishReason.ABORT
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one engine step ----------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self.steps += 1
        started = time.perf_counter()
        self._admit()
        group = self._next_group()
        collect_started = time.perf_counter()
        self._collect_drafts(group)
        draft_s = time.perf_counter() - collect_started  # the drafter client's share
        if not self.config.draft_ahead:  # NOTE: look-aheads build on the drafter's own drafts
            guide_drafts(group)  # structured output: text the grammar forces is drafted
        drafts_ready = time.perf_counter()
        outputs = self._reap()
        group = [r for r in group if not r.finished]
        work = self._reserve(schedule(group, self.config.max_batch_tokens,
                                      self.config.prefill_chunk))
        if not work:
            self._observe(started, drafts_ready, (), (), outputs)
            return outputs
        work = self._choose_depths(work)
        if self.claims.snapshots is not None:  # states at block ends (prefix caching)
            self.claims.snapshots.plan(work, self.allocator.block_size)
        forward_started = time.perf_counter()
        result = run_verify(self.model, self.cache, work, self.device, self.graphs,
                            self.eos_ids)
        forward_s = time.perf_counter() - forward_started
        self._take_ahead()  # NOTE: look-aheads that came in during the forward count too
        updates: list[SeqUpdate] = []
        for i, (item, verdict) in enumerate(zip(work, result.verdicts, strict=True)):
            out = self._commit(item, verdict)
            if out is not None:
                outputs.append(out)
            upd = self._draft_update(item, verdict, result, i)
            if upd is not None:
                updates.append(upd)
        if updates and self.drafter is not None:
            submit_started = time.perf_counter()
            self.drafter.submit(updates)
            draft_s += time.perf_counter() - submit_started
        if self.depth is not None:  # NOTE: before _reap, which forgets finished sequences
            self._learn_depth(work, result.verdicts, updates, forward_s, draft_s, started)
        outputs.extend(self._reap())
        self._observe(started, drafts_ready, work, result.verdicts, outputs)
        return outputs

    # -- draft depth (DESIGN 4.11) --------------------------------------------------------
    def _choose_depths(self, work: list[Work]) -> list[Work]:
        """Truncate each verify window's drafts to the depth chosen for it: the request's
        cap, and under adaptive depth the policy's k, to what the request can still
        commit (`Request.draft_budget`: its expected tokens are the policy's yield).
        NOTE: fewer drafts only: every token is still decided by the acceptance rule, so
        output cannot change."""
        verify = [i for i, w in enumerate(work) if w.kind is WorkKind.VERIFY]
        caps = [work[i].request.max_drafts for i in verify]
        adaptive = self.depth is not None and self.drafter is not None
        if adaptive and verify:
            other = sum(w.num_rows for w in work if w.kind is not WorkKind.VERIFY)
            keys = [self.seq_ids[work[i].request.request_id] for i in verify]
            demand = min(len(self.running) + len(self.waiting), self.config.max_seqs)
            caps = self.depth.depths(keys, [min(c, work[i].request.draft_budget)
                                            for c, i in zip(caps, verify, strict=True)],
                                     other, demand)
        out = list(work)
        drafting = any(caps)  # NOTE: a round runs anyway: every sequence that may draft asks
        if adaptive:  # a new prompt asks for drafts only while others draft (or none run)
            drafting = drafting if verify else not self.depth.plain_steps
            for w in work:
                if w.kind is WorkKind.PREFILL:
                    w.request.wants_drafts = drafting and w.request.max_drafts > 0
        for i, k in zip(verify, caps, strict=True):
            w = out[i]
            if k == 0 and (w.num_drafts or not w.request.wants_drafts):
                w.request.draft_miss = "depth"  # NOTE: metrics: a fallback by choice
            w.request.wants_drafts = k > 0 or (drafting and w.request.max_drafts > 0)
            if w.num_drafts > k:
                out[i] = replace(w, tokens=w.tokens[:1 + k], num_drafts=k,
                                 ahead=w.ahead and k > 0)
        return out

    def _learn_depth(self, work: Sequence[Work], verdicts, updates: Sequence[SeqUpdate],
                     forward_s: float, draft_s: float, started: float) -> None:
        """`draft_s`: the step's time in the drafter client; `updates`: what it sent."""
        overhead_s = time.perf_counter() - started - forward_s - draft_s
        for w, verdict in zip(work, verdicts, strict=True):
            if w.kind is WorkKind.VERIFY and w.num_drafts:
                self.depth.observe_round(self.seq_ids[w.request.request_id], w.num_drafts,
                                         verdict.accepted)
        verify = [(w, v) for w, v in zip(work, verdicts, strict=True)
                  if w.kind is WorkKind.VERIFY]
        self.depth.observe_step(sum(w.num_rows for w in work), forward_s, overhead_s, draft_s,
                                any(u.want_drafts for u in updates),
                                any(w.kind is WorkKind.PREFILL for w in work), started,
                                len(verify), any(w.num_drafts for w, _ in verify),
                                not self.waiting and all(r.finished for r in self.running),
                                self._drafter_busy(),
                                max((u.num_drafts or self.config.num_steps for u in updates
                                     if u.want_drafts), default=0))

    def _observe(self, started: float, drafts_ready: float, work, verdicts, outputs) -> None:
        if self.observer is None:
            return
        kv = self.allocator.usage
        groups = len({r.group for r in self.running}) if self.drafter is not None else 1
        self.observer.step_done(VerifierStepRecord(
            started, drafts_ready, time.perf_counter(), work, verdicts, outputs,
            len(self.running), len(self.waiting), kv, self.drafter is not None,
            max(1, groups), *self._step_ahead))
        self._step_ahead = [0, 0]

    def _next_group(self) -> list[Request]:
        """The running sequences whose turn it is (all of them without pipelining)."""
        groups = self.config.groups if self.drafter is not None else 1
        if groups == 1:
            return list(self.running)
        for _ in range(groups):
            turn, self._turn = self._turn, (self._turn + 1) % groups
            members = [r for r in self.running if r.group == turn]
            if members:
                return members
        return []

    def _admit(self) -> None:
        """Fill free slots in fair order; then, while a party waits for a slot, one that
        holds more than its share gives way (engine/admission.py)."""
        while True:
            self._admit_free()
            if len(self.running) < self.config.max_seqs:
                return  # waiting for blocks, or nobody waits
            victim = fair_victim(self.waiting, self.running)
            if victim is None:
                return
            self._preempt(victim)
            self.preemptions += 1

    def _admit_free(self) -> None:
        while len(self.running) < self.config.max_seqs:
            req = next_admission(self.waiting, self.running)  # NOTE: _reap ends finished ones
            if req is None or not preemption.admit_blocks(req, self.allocator,
                                                          self.config.num_steps,
                                                          self._follow(req), self.claims):
                break  # nobody waits, or wait for blocks
            self.waiting.remove(req)
            sizes = [0] * self.config.groups
            for r in self.running:
                sizes[r.group] += 1
            req.group = sizes.index(min(sizes))  # the smallest group
            # a hit on a hybrid model starts from the state snapshot at its end
            self.claims.claim(req.claims, req.block_hashes[req.num_cached - 1]
                              if req.num_cached else None)
            self.running.append(req)

    def _follow(self, req: Request) -> int:
        """Tokens after a cached block that a drafter's key for it covers: 0 where no
        drafter will hold `req` (none attached, or the request never drafts), and while
        adaptive depth decodes plain: `req` then reads its whole hit as plain decoding
        does, and pays a resync only if drafting resumes in its life (a plain spell
        sends the drafter nothing, so it holds no key of the prompts it saw)."""
        if self.drafter is None or req.max_drafts == 0:
            return 0
        if self.depth is not None and self.depth.plain_steps:
            return 0
        return self.config.num_steps

    def _reserve(self, work: list[Work]) -> list[Work]:
        """Blocks for the rows `work` writes; short of them, preempt (module preemption)."""
        work, victims = preemption.reserve(work, self.running, self.allocator)
        for w in work:  # NOTE: never short: sized for every running sequence
            self.claims.ensure(w.request.claims, w.start + w.num_rows)
        for req in victims:  # NOTE: victims come newest first: admission order
            self._preempt(req)
        self.preemptions += len(victims)
        return work

    def _preempt(self, req: Request) -> None:
        """`req` leaves the running set to be recomputed later, first in line."""
        self.running.remove(req)
        req.blocks.release(self.allocator)  # NOTE: a no-op for reserve's victims
        self.claims.release(req.claims)
        preemption.requeue(req)
        self.waiting.insert(0, req)
        if self.drafter is not None:
            self._release_drafter(req)

    def _reap(self) -> list[RequestOutput]:
        """Finished requests leave: free the slot, release the drafter's state."""
        outputs, done = [], []
        for req in self.waiting + self.running:
            if req.finished:
                done.append(req)
        for req in done:
            if req in self.waiting:
                self.waiting.remove(req)
                if req.finish_reason is not FinishReason.ABORT and not req.error:
                    # NOTE: a continuation whose output was already complete
                    outputs.append(RequestOutput(req.request_id, (), req.finish_reason,
                                                 req.stop_string, stats=req.stats))
            else:
                self.running.remove(req)
                req.blocks.release(self.allocator)
                self.claims.release(req.claims)
            if self.drafter is not None:
                self._release_drafter(req)
            if self.depth is not None:
                self.depth.forget(self.seq_ids[req.request_id])
            del self.by_id[req.request_id], self.seq_ids[req.request_id]
            if req.finish_reason is FinishReason.ABORT or req.error:
                outputs.append(RequestOutput(req.request_id, (), req.finish_reason,
                                             error=req.error, stats=req.stats))
        return outputs

    # -- commit ---------------------------------------------------------------------
    def _commit(self, item: Work, verdict: VerifyResult | None) -> RequestOutput | None:
        req = item.request
        if verdict is None:  # a prefill chunk that does not finish the prompt
            req.num_computed += item.num_rows
            self._advance_claims(req, 0)
            self._cache_committed(item, 0)
            return None
        accepted = verdict.accepted
        if item.kind is WorkKind.VERIFY:
            if item.num_drafts:
                req.stats.record(item.num_drafts, accepted)
            else:
                req.stats.fallback_rounds += self.drafter is not None
        new = [*item.tokens[1:1 + accepted], verdict.next_token] \
            if item.kind is WorkKind.VERIFY else [verdict.next_token]
        req.num_computed = item.start + (accepted + 1 if item.kind is WorkKind.VERIFY
                                         else item.num_rows)
        self._advance_claims(req, accepted if item.kind is WorkKind.VERIFY else 0)
        req.drafts = self._ahead_drafts(req, item.start, new)
        req.drafts_ahead = req.drafts is not None
        emitted = self._append_until_stop(req, new)
        self._cache_committed(item, accepted)  # NOTE: after the append: hashes read tokens
        final = req.finish_reason is not None
        logprobs = None if verdict.logprobs is None else verdict.logprobs[:len(emitted)]
        return RequestOutput(req.request_id, tuple(emitted), req.finish_reason,
                             req.stop_string, stats=req.stats if final else None,
                             logprobs=logprobs)

    def _advance_claims(self, req: Request, kept_row: int) -> None:
        """After a commit: the state after the last committed row is at `kept_row`
        (DESIGN 4.9: nothing recomputed)."""
        req.claims.state_row = kept_row

    def _cache_committed(self, item: Work, accepted: int) -> None:
        """Prefix caching (DESIGN 4.12): the committed full blocks (window groups' too),
        and a hybrid model's states at their ends (engine/state_snapshots.py); then the
        window blocks no row can see go back (cached ones stay cached, idle)."""
        preemption.cache_committed(item.request, self.allocator, self.claims)
        if self.claims.snapshots is not None:
            self.claims.snapshots.commit(item, accepted, self.allocator.block_size)
        self.claims.trim(item.request.claims, item.request.num_computed)

    def _append_until_stop(self, req: Request, new: list[int]) -> list[int]:
        emitted = []
        for tok in new:
            req.tokens.append(tok)
            emitted.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                req.finish_reason = reason
                break
        return emitted

    def _stop_reason(self, req: Request, tok: int) -> FinishReason | None:
        stop = req.stop
        if tok in self.eos_ids and not stop.ignore_eos:
            return FinishReason.EOS
        if tok in stop.stop_token_ids:
            return FinishReason.STOP
        if req.num_generated < req.sampling.min_tokens:
            return None  # NOTE: EOS/stop ids were masked; stop strings wait too (vLLM)
        if stop.stop_strings and self.detokenize is not None:
            tail = stop_tail(self.detokenize, req.tokens, req.num_generated)
            for s in stop.stop_strings:
                if s in tail:
                    req.stop_string = s
                    return FinishReason.STOP
        if req.num_generated >= stop.max_tokens:
            return FinishReason.LENGTH
        return None

    # -- drafter protocol -------------------------------------------------------------

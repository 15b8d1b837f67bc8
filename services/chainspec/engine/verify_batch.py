"""One target forward over a step's work, and batched acceptance of its verify windows.

Every item that commits tokens is treated as a verify window with num_drafts in [0, K]:
a plain decode row and the last prompt chunk are windows with no drafts. So plain
decoding and speculative decoding share one code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chainspec.engine.acceptance import (
    accept_coupled,
    accept_greedy,
    accept_sampled,
    coupled_noise,
    round_noise,
)
from chainspec.engine.grammar_mask import GrammarMasks
from chainspec.engine.logits_processors import LogitsProcessing, WindowRequest
from chainspec.engine.logprobs import TokenLogprob, host_logprobs, window_logprobs
from chainspec.engine.sampling import SamplingBatch
from chainspec.engine.schedule import Work, WorkKind
from chainspec.engine.verify_graphs import VerifyGraphs, seq_rows, verify_forward
from chainspec.models.attention import AttnBatch
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.target import TargetModel


@dataclass(frozen=True)
class VerifyResult:
    accepted: int  # drafts accepted (0 for prefill and plain decode)
    next_token: int  # the bonus, or the residual sample after a rejection
    # one per committed token (accepted drafts, then next_token) when the request asked
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class StepResult:
    hidden: torch.Tensor  # [T, H]: exported hidden states of every row of the step
    offsets: tuple[int, ...]  # first packed row of each work item
    verdicts: tuple[VerifyResult | None, ...]  # None: a prefill chunk that commits nothing

    def hidden_rows(self, item: int, rows: int) -> torch.Tensor:
        """The first `rows` hidden states of work item `item`, on the host: [rows, H]."""
        start = self.offsets[item]
        return self.hidden[start:start + rows].float().cpu()


def run_verify(model: TargetModel, cache: ModelKVCache, work: Sequence[Work],
               device: torch.device, graphs: VerifyGraphs | None = None,
               eos_ids: frozenset[int] = frozenset()) -> StepResult:
    """Forward all rows of `work`, then accept/sample for the items that commit. Decode and
    verify steps go through `graphs` (static buffers, CUDA graphs) when they fit.
    `eos_ids`: what min_tokens holds back besides each request's stop token ids."""
    if graphs is not None and graphs.fits(work):
        hidden, offsets = graphs.run(work)
    else:
        hidden, offsets = _packed_forward(model, cache, work, device)
    deciders = [i for i, w in enumerate(work) if w.samples]
    verdicts: list[VerifyResult | None] = [None] * len(work)
    if deciders:
        for i, v in zip(deciders, _decide(model, hidden, [work[i] for i in deciders],
                                          [offsets[i] for i in deciders], eos_ids),
                        strict=True):
            verdicts[i] = v
    return StepResult(hidden, tuple(offsets), tuple(verdicts))


def _packed_forward(model: TargetModel, cache: ModelKVCache, work: Sequence[Work],
                    device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Rows packed back to back (prefill chunks, and everything when not captured)."""
    batch = AttnBatch.build([seq_rows(w) for w in work], cache.block_size, device,
                            windows=cache.windows, with_states=cache.has_states)
    ids = torch.tensor([t for w in work for t in w.tokens], device=device)
    offsets, total = [], 0
    for w in work:
        offsets.append(total)
        total += w.num_rows
    return verify_forward(model, cache, ids, batch), tuple(offsets)


def _decide(model: TargetModel, hidden: torch.Tensor, work: Sequence[Work],
            offsets: Sequence[int], eos_ids: frozenset[int]) -> list[VerifyResult]:
    """Batched acceptance over the deciding items, padded to K+1 rows each."""
    k = max(w.num_drafts for w in work)
    b = len(work)
    device = hidden.device
    rows: list[int] = []
    drafts_list: list[int] = []
    for w, off in zip(work, offsets, strict=True):
        # VERIFY rows are x[N], d1..dk: logits of row i judge draft i+1; the last prompt
        # chunk decides from its last row. Padding repeats the item's last row.
        first = off if w.kind is WorkKind.VERIFY else off + w.num_rows - 1
        rows.extend(first + min(i, w.num_drafts) for i in range(k + 1))
        drafts_list.extend(w.tokens[1:1 + w.num_drafts] if w.num_drafts else ())
        drafts_list.extend([0] * (k - w.num_drafts))
    row_idx = torch.tensor(rows, device=device)
    drafts = torch.tensor(drafts_list, dtype=torch.int64, device=device).view(b, k)
    num_drafts = torch.tensor([w.num_drafts for w in work], device=device)
    logits = model.logits(hidden[row_idx]).view(b, k + 1, -1)
    raw = logits
    params = [w.request.sampling for w in work]
    if any(p.processes_logits for p in params):  # NOTE: outside any captured graph
        processing = LogitsProcessing.build([_window_request(w, eos_ids) for w in work],
                                            logits.shape[-1], device)
        logits = processing.apply(logits, drafts, num_drafts)  # [B, K+1, V]
    masks = GrammarMasks.build([w.request.grammar for w in work],
                               [w.tokens[1:1 + w.num_drafts] for w in work], k + 1,
                               logits.shape[-1])
    if masks is not None:  # structured output: after processing, before acceptance
        logits = masks.apply(logits, raw if logits is not raw else None)
    if all(p.greedy for p in params):
        accepted, nxt = accept_greedy(logits, drafts, num_drafts)
    else:
        accepted, nxt = _accept_sampled(logits, drafts, num_drafts, work, params)
    wanted = [p.num_logprobs for p in params]
    top_n = max((n for n in wanted if n is not None), default=None)
    window = None if top_n is None else window_logprobs(logits, drafts, accepted, nxt, top_n)
    pairs = torch.stack([accepted, nxt], dim=1).tolist()  # the step's one host sync
    if masks is not None:
        masks.settle(pairs)
    if window is None:
        return [VerifyResult(a, t) for a, t in pairs]
    window = type(window)(*(x.cpu() for x in (window.chosen, window.top_ids,
                                                window.top_values)))  # after the sync
    return [VerifyResult(a, t, None if n is None else host_logprobs(
        window, i, [*drafts_list[i * k:i * k + a], t], n))
        for i, ((a, t), n) in enumerate(zip(pairs, wanted, strict=True))]


def _window_request(w: Work, eos_ids: frozenset[int]) -> WindowRequest:
    req = w.request
    stop = req.stop.stop_token_ids if req.stop.ignore_eos else \
        (*eos_ids, *req.stop.stop_token_ids)
    return WindowRequest(req.sampling, req.tokens[:req.prompt_len],
                         req.tokens[req.prompt_len:], frozenset(stop))


def _accept_sampled(logits, drafts, num_drafts, work, params):
    """Seeded requests take the coupled rule (their tokens are the plain keyed samples,
    whatever the drafts), the others Leviathan's (docs/design.md, "Seeded requests")."""
    sampling = SamplingBatch.from_params(params, logits.device)
    probs = sampling.target_probs(logits)  # [B, K+1, V]
    first_pos = torch.tensor([w.start + w.num_rows if w.kind is WorkKind.PREFILL
                              else w.start + 1 for w in work], device=logits.device)
    seeded = [w.request.seeded for w in work]
    coupled = None
    if any(seeded):
        noise = coupled_noise(sampling.seed, first_pos, drafts.shape[1] + 1, logits.shape[-1])
        coupled = accept_coupled(probs, drafts, num_drafts, noise)
        if all(seeded):
            return coupled
    leviathan = _accept_leviathan(probs, drafts, num_drafts, work, sampling.seed, first_pos)
    if coupled is None:
        return leviathan
    mask = torch.tensor(seeded, device=logits.device)  # [B]
    return tuple(torch.where(mask, c, lv) for c, lv in zip(coupled, leviathan, strict=True))


def _accept_leviathan(probs, drafts, num_drafts, work, seed, first_pos):
    k = drafts.shape[1]
    support = probs_q = None
    if k and any(w.request.drafts is not None and w.request.drafts.support is not None
                 for w in work):
        support, probs_q = _draft_dists(work, k, probs.device)
    accept_u, noise = round_noise(seed, first_pos, k, probs.shape[-1])
    return accept_sampled(probs, drafts, support, probs_q, num_drafts, accept_u, noise)


def _draft_dists(work: Sequence[Work], k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft distributions [B, K, top_k]; point masses for items with greedy drafts."""
    top = next(w.request.drafts.support.shape[-1] for w in work
               if w.request.drafts is not None and w.request.drafts.support is not None)
    support = torch.zeros(len(work), k, top, dtype=torch.int64)
    probs = torch.zeros(len(work), k, top)
    for i, w in enumerate(work):
        d = w.request.drafts
        n = w.num_drafts
        if d is not None and d.support is not None:
            support[i, :n], probs[i, :n] = d.support[:n], d.probs[:n]
        elif n:
            support[i, :n, 0] = torch.tensor(w.tokens[1:], dtype=torch.int64)
            probs[i, :n, 0] = 1.0
    return support.to(device), probs.to(device)

"""Acceptance rules (DESIGN 3.3), batched over B sequences with up to K drafts each.

Pure functions of tensors: no host sync, no loop over the batch. Draft i (0-based) sits at
position N+1+i and is checked against target row i; row j = accepted_len gives the next
token. Sequences with fewer drafts pass num_drafts [B] (padding entries may hold anything).

Coupled rule (seeded requests, `accept_coupled`): the target's choice at each row is its
own exponential race with noise keyed by (seed, position); a draft is accepted iff it is
that choice, so the committed tokens never depend on the drafts (docs/design.md,
"Seeded requests").

Sampled rule (Leviathan et al. 2023, Chen et al. 2023; unseeded requests): accept d_i
with probability min(1, p(d_i) / q(d_i)); at the first rejection draw from
normalize(max(p - q, 0)); after all drafts are accepted draw the bonus from p. q is a point
mass on d_i (greedy drafts: `draft_support` None) or a top-k-truncated distribution given
as support/probs [B, K, k].
`accept_greedy` and `accept_sampled` dispatch to one Triton launch (kernels/acceptance.py)
on CUDA when that module's ENABLED is set (off: measured slower, see there), and to the
`*_reference` torch code here otherwise; the reference is the kernel's oracle.
"""

from __future__ import annotations

import torch

from chainspec.engine.sampling import NoiseStream, exponential_noise, sample, uniform
from chainspec.kernels import acceptance as acceptance_kernels
from chainspec.kernels.triton_support import use_kernel


def accept_greedy(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """target logits [B, K+1, V] or argmax ids [B, K+1]; drafts [B, K]; num_drafts [B] ->
    accepted_len [B] (drafts accepted while d_i == argmax row i), bonus [B] = argmax row j."""
    if acceptance_kernels.ENABLED and target.dim() == 3 and use_kernel(target):
        return acceptance_kernels.accept_greedy(target, drafts, num_drafts)
    return accept_greedy_reference(target, drafts, num_drafts)


def accept_greedy_reference(target: torch.Tensor, drafts: torch.Tensor,
                            num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_greedy` in torch: the CPU path and the kernel's test oracle."""
    top = target.argmax(dim=-1) if target.dim() == 3 else target  # [B, K+1]
    k = drafts.shape[1]
    valid = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]  # [B, K]
    accepted_len = _prefix_len(valid & (drafts == top[:, :k]))  # [B]
    return accepted_len, top.gather(1, accepted_len[:, None]).squeeze(1)


def accept_coupled(target_probs: torch.Tensor, drafts: torch.Tensor,
                   num_drafts: torch.Tensor, noise: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The coupled rule: the target's choice at row i is its own race c_i = argmax(p_i / E_i)
    with E_i keyed (SAMPLE, N+1+i) (`coupled_noise`); accept d_i while d_i == c_i, and the
    next token is c_j. So the committed tokens are the plain keyed samples, whatever the
    drafts were. target_probs [B, K+1, V]; drafts [B, K]; num_drafts [B];
    noise Exp(1) [B, K+1, V] -> accepted_len [B], next_token [B]."""
    return accept_greedy(sample(target_probs, noise), drafts, num_drafts)


def coupled_noise(seed: torch.Tensor, first_pos: torch.Tensor, rows: int,
                  vocab_size: int) -> torch.Tensor:
    """Noise of `accept_coupled`: seed [B] int64, first_pos [B] = N+1 -> Exp(1)
    [B, rows, V], row i keyed (SAMPLE, N+1+i): the absolute position the row decides,
    never the batch slot, the round or K."""
    positions = first_pos[:, None] + torch.arange(rows, device=first_pos.device)  # [B, rows]
    return exponential_noise(seed[:, None], NoiseStream.SAMPLE, positions, vocab_size)


def accept_sampled(target_probs: torch.Tensor, drafts: torch.Tensor,
                   draft_support: torch.Tensor | None, draft_probs: torch.Tensor | None,
                   num_drafts: torch.Tensor, accept_uniform: torch.Tensor,
                   sample_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, K+1, V]; drafts [B, K]; draft_support/draft_probs [B, K, k] or None
    (point mass); num_drafts [B]; accept_uniform U(0,1) [B, K]; sample_noise Exp(1) [B, V]
    -> accepted_len [B], next_token [B] (residual sample after a rejection, else bonus)."""
    if acceptance_kernels.ENABLED and use_kernel(target_probs):
        return acceptance_kernels.accept_sampled(target_probs, drafts, draft_support,
                                                 draft_probs, num_drafts, accept_uniform,
                                                 sample_noise)
    return accept_sampled_reference(target_probs, drafts, draft_support, draft_probs,
                                    num_drafts, accept_uniform, sample_noise)


def accept_sampled_reference(target_probs: torch.Tensor, drafts: torch.Tensor,
                             draft_support: torch.Tensor | None,
                             draft_probs: torch.Tensor | None, num_drafts: torch.Tensor,
                             accept_uniform: torch.Tensor, sample_noise: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_sampled` in torch: the CPU path and the kernel's test oracle."""
    accepted_len, dist = next_token_distribution(
        target_probs, drafts, draft_support, draft_probs, num_drafts, accept_uniform)
    return accepted_len, sample(dist, sample_noise)


def next_token_distribution(target_probs: torch.Tensor, drafts: torch.Tensor,
                            draft_support: torch.Tensor | None,
                            draft_probs: torch.Tensor | None, num_drafts: torch.Tensor,
                            accept_uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept phase of `accept_sampled`: -> accepted_len [B] and the distribution
    [B, V] the next token is drawn from (residual at row j, or p at row j)."""
    b, rows, v = target_probs.shape
    k = rows - 1
    if k == 0:
        return torch.zeros(b, dtype=torch.long, device=drafts.device), target_probs[:, 0]
    q_d, usable = _draft_prob(drafts, draft_support, draft_probs, num_drafts, v)  # [B, K]
    safe = drafts.clamp(0, v - 1)  # [B, K]
    p_d = target_probs[:, :k].gather(-1, safe[..., None]).squeeze(-1)  # [B, K]
    accepted_len = _prefix_len(usable & draft_acceptance(p_d, q_d, accept_uniform))  # [B]
    rejected = accepted_len < _prefix_len(usable)  # [B]
    p_row = target_probs.gather(1, accepted_len[:, None, None].expand(b, 1, v)).squeeze(1)
    q_row = _draft_dist(safe, draft_support, draft_probs, accepted_len.clamp(max=k - 1), v)
    dist = torch.where(rejected[:, None], residual(p_row, q_row), p_row)  # [B, V]
    return accepted_len, dist


def draft_acceptance(p_d: torch.Tensor, q_d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p/q): u < p/q, written u*q < p (no division). All
    [B, K]. p = 0 never accepts; p >= q always does (u < 1)."""
    return u * q_d < p_d


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) over the last dim; where that is all zero (p <= q
    everywhere, i.e. p == q up to rounding, so a rejection had probability ~0) fall back
    to p."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def round_noise(seed: torch.Tensor, first_pos: torch.Tensor, num_slots: int,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise for one Leviathan verify round. seed [B] int64; first_pos [B] = N+1, the
    position of draft 1 (and of the next token when there are no drafts) ->
    accept_uniform [B, K] keyed (ACCEPT, N+1+i), sample_noise [B, V] keyed (RESIDUAL, N+1).
    NOTE: the next token lands at N+1+j but its noise is keyed by N+1, known before
    acceptance; rounds start at strictly increasing positions, so no key is reused. Drafts
    race on SAMPLE, so both streams are independent of them."""
    positions = first_pos[:, None] + torch.arange(num_slots, device=first_pos.device)
    accept_u = uniform(seed[:, None], NoiseStream.ACCEPT, positions, 1).squeeze(-1)
    return accept_u, exponential_noise(seed, NoiseStream.RESIDUAL, first_pos, vocab_size)


def _prefix_len(ok: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] int64: length of the leading run of True."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def _draft_prob(drafts: torch.Tensor, support: torch.Tensor | None,
                probs: torch.Tensor | None, num_drafts: torch.Tensor, v: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """q(d_i) [B, K] and usable [B, K]: i < num_drafts, token in [0, V), and q(d_i) > 0.
    NOTE: a draft outside its own support (q = 0) is a drafter bug; treating it as the end
    of the drafts keeps the output exact (that position is sampled from p)."""
    k = drafts.shape[1]
    usable = (torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]) & (
        drafts >= 0) & (drafts < v)
    if support is None:
        return torch.ones_like(drafts, dtype=torch.float32), usable
    q_d = (probs.float() * (support == drafts[..., None])).sum(dim=-1)  # [B, K]
    return q_d, usable & (q_d > 0)


def _draft_dist(safe: torch.Tensor, support: torch.Tensor | None, probs: torch.Tensor | None,
                row: torch.Tensor, v: int) -> torch.Tensor:
    """q of draft `row` [B] scattered into the vocab: [B, V]."""
    b = safe.shape[0]
    q = torch.zeros(b, v, dtype=torch.float32, device=safe.device)
    if support is None:
        return q.scatter_(1, safe.gather(1, row[:, None]), 1.0)
    idx = row[:, None, None].expand(b, 1, support.shape[-1])
    sup = support.gather(1, idx).squeeze(1)  # [B, k]
    pr = probs.float().gather(1, idx).squeeze(1)  # [B, k]
    ok = (sup >= 0) & (sup < v)
    return q.scatter_add_(1, sup.clamp(0, v - 1), pr * ok)

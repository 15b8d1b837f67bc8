"""Training objectives over a `[batch, seq_len]` block of token ids.

Target row p predicts x[p+1]. MTP module k at row p reads emb(x[p+k]) and g[k-1][p]
(g[0] = h, the target's hidden state after the final norm; g[k] = module k's block output
before its final norm, i.e. chain mode) and predicts x[p+k+1]; rows whose label falls
past the block are dropped. Two objectives:
- joint (DeepSeek-V3 MTP loss): CE_target + lambda * mean_k CE_k against the corpus;
- distill (frozen target): mean_k of CE between module k at row p and the target's
  distribution at row p+k (given the true prefix), which is what greedy acceptance tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chainspec.models.attention import DenseCausal
from chainspec.training.mtp_model import TargetWithMTP


@dataclass(frozen=True)
class Forward:
    target_logits: torch.Tensor  # [B, T, V]
    mtp_logits: tuple[torch.Tensor, ...]  # K x [B, T, V]; module k row p predicts x[p+k+1]


def shift_left(ids: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] -> x[p+k] per row, zero-padded past the end (rows whose loss is dropped)."""
    return torch.cat([ids[:, k:], ids.new_zeros(ids.shape[0], k)], dim=1)


def run_model(model: TargetWithMTP, ids: torch.Tensor, grad_target: bool = True) -> Forward:
    """Target and chained MTP modules over a dense causal block (on the model's device)."""
    ids = ids.to(model.device)
    batch, seq_len = ids.shape
    positions = torch.arange(seq_len, device=ids.device).repeat(batch)  # [B*T]
    backend = DenseCausal(batch, seq_len, model.target.attention_scale)
    with torch.set_grad_enabled(grad_target and torch.is_grad_enabled()):
        hidden = model.target(ids.flatten(), positions, backend)  # [B*T, H]
        target_logits = model.target.logits(hidden).view(batch, seq_len, -1)
    prev, mtp_logits = hidden, []
    for k in range(1, model.num_mtp + 1):
        g = model.draft.step(k, shift_left(ids, k).flatten(), prev, positions, backend)
        mtp_logits.append(model.draft.logits(k, g).view(batch, seq_len, -1))
        prev = model.draft.next_input(k, g, hidden)  # the family's chain rule, as drafted
    return Forward(target_logits, tuple(mtp_logits))


def target_ce(fwd: Forward, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(fwd.target_logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def mtp_ce(fwd: Forward, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per module: CE against the corpus token x[p+k+1]."""
    seq_len = ids.shape[1]
    return [F.cross_entropy(logits[:, : seq_len - k - 1].flatten(0, 1),
                            ids[:, k + 1:].flatten())
            for k, logits in enumerate(fwd.mtp_logits, start=1)]


def mtp_distill(fwd: Forward) -> list[torch.Tensor]:
    """Per module: soft CE against the (detached) target distribution at row p+k."""
    seq_len = fwd.target_logits.shape[1]
    losses = []
    for k, logits in enumerate(fwd.mtp_logits, start=1):
        teacher = fwd.target_logits[:, k:].detach().softmax(-1)  # [B, T-k, V]
        student = logits[:, : seq_len - k].log_softmax(-1)
        losses.append(-(teacher * student).sum(-1).mean())
    return losses


def greedy_agreement(fwd: Forward) -> tuple[torch.Tensor, int]:
    """Chained greedy acceptance over a block -> (accepted [K] int64, rounds): at row p,
    draft k counts when drafts 1..k equal the target's argmax at rows p+1..p+k (each
    given the true prefix); rounds = the B * (T - K) rows that have a target row p+K."""
    k_max = len(fwd.mtp_logits)
    batch, seq_len = fwd.target_logits.shape[:2]
    rows = seq_len - k_max
    target = fwd.target_logits.argmax(-1)  # [B, T]
    ok = torch.ones(batch, rows, dtype=torch.bool, device=target.device)
    accepted = []
    for k, logits in enumerate(fwd.mtp_logits, start=1):
        ok = ok & (logits[:, :rows].argmax(-1) == target[:, k: k + rows])
        accepted.append(ok.sum())
    return torch.stack(accepted), batch * rows


def joint_loss(fwd: Forward, ids: torch.Tensor, mtp_weight: float
               ) -> tuple[torch.Tensor, dict[str, float]]:
    base, heads = target_ce(fwd, ids), mtp_ce(fwd, ids)
    loss = base + mtp_weight * torch.stack(heads).mean()
    return loss, _metrics(base, heads)


def distill_loss(fwd: Forward, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    soft = mtp_distill(fwd)
    with torch.no_grad():
        metrics = _metrics(target_ce(fwd, ids), mtp_ce(fwd, ids))
        counts, rounds = greedy_agreement(fwd)
    metrics.update({f"distill{k}": float(x.detach()) for k, x in enumerate(soft, start=1)})
    metrics.update({f"acc{k}": float(c) / rounds for k, c in enumerate(counts, start=1)})
    return torch.stack(soft).mean(), metrics


def _metrics(base: torch.Tensor, heads: list[torch.Tensor]) -> dict[str, float]:
    out = {"target": float(base.detach())}
    out.update({f"mtp{k}": float(x.detach()) for k, x in enumerate(heads, start=1)})
    return out

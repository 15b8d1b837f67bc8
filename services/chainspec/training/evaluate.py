"""Held-out greedy acceptance of the chained MTP drafts at K steps, measured two ways.

(a) teacher-forced: over held-out windows, draft step k at row p is accepted when the
    chained MTP prediction (inputs: h[p] and the true tokens x[p+1..p+k]) equals the
    target's argmax at row p+k given the true prefix, and steps 1..k-1 were accepted.
(b) simulated self-speculation: greedy generation where every round drafts K tokens by
    running the chained modules from scratch over the committed prefix (DESIGN 3.1:
    module k reads x[p+k], with this round's drafts past the bonus token) and one target
    forward over prefix + drafts verifies them (DESIGN 3.3, greedy rule).

Both report, per draft position k, the fraction of rounds in which step k was accepted,
and the mean acceptance length = 1 + sum_k rate_k (accepted drafts + the bonus token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chainspec.models.attention import DenseCausal
from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel
from chainspec.training.mtp_model import TargetWithMTP
from chainspec.training.objective import greedy_agreement, run_model


@dataclass(frozen=True)
class Acceptance:
    rounds: int
    accepted: tuple[int, ...]  # per position k: rounds in which step k was accepted

    @property
    def rates(self) -> tuple[float, ...]:
        return tuple(a / max(self.rounds, 1) for a in self.accepted)

    @property
    def conditional(self) -> tuple[float, ...]:
        """P(step k accepted | step k-1 accepted)."""
        prev = (self.rounds, *self.accepted[:-1])
        return tuple(a / max(p, 1) for a, p in zip(self.accepted, prev, strict=True))

    @property
    def mean_length(self) -> float:
        return 1.0 + sum(self.rates)


@torch.no_grad()
def teacher_forced(model: TargetWithMTP, windows: torch.Tensor) -> Acceptance:
    """windows [n, T] of held-out tokens."""
    rounds, accepted = 0, torch.zeros(model.num_mtp, dtype=torch.int64)
    for ids in windows.split(4):
        counts, rows = greedy_agreement(run_model(model, ids))  # run_model moves ids
        accepted += counts.cpu()  # NOTE: a host sync per window (evaluation only)
        rounds += rows
    return Acceptance(rounds, tuple(int(a) for a in accepted))


def _target_forward(model: TargetWithMTP, tokens: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-prefix target forward -> (hidden [n, H], argmax [n])."""
    ids = torch.tensor(tokens, device=model.device)
    backend = DenseCausal(1, len(tokens), model.target.attention_scale)
    hidden = model.target(ids, torch.arange(len(tokens), device=model.device), backend)
    return hidden, model.target.logits(hidden).argmax(-1)


def draft_from_scratch(model: TargetWithMTP, tokens: list[int], hidden: torch.Tensor
                       ) -> list[int]:
    """K chained drafts after committed `tokens` (last = bonus), from h of rows < bonus."""
    rows = len(tokens) - 1  # rows 0..N'-1
    positions = torch.arange(rows, device=model.device)
    backend = DenseCausal(1, rows, model.target.attention_scale)
    prev, drafts = hidden[:rows], []
    for k in range(1, model.num_mtp + 1):
        inputs = torch.tensor((tokens + drafts)[k: k + rows], device=model.device)  # x[p+k]
        g = model.draft.step(k, inputs, prev, positions, backend)  # g[k] [rows, H]
        drafts.append(int(model.draft.logits(k, g[-1:]).argmax(-1)))
        prev = model.draft.next_input(k, g, hidden[:rows])
    return drafts


@torch.no_grad()
def self_speculate(model: TargetWithMTP, prompt: list[int], max_new: int, eos: int
                   ) -> tuple[list[int], Acceptance]:
    """Greedy speculative generation; returns (generated tokens, acceptance counts)."""
    hidden, argmax = _target_forward(model, prompt)
    tokens = prompt + [int(argmax[-1])]  # first bonus
    accepted, rounds = [0] * model.num_mtp, 0
    while len(tokens) - len(prompt) < max_new and tokens[-1] != eos:
        drafts = draft_from_scratch(model, tokens, hidden)
        hidden, argmax = _target_forward(model, tokens + drafts)  # verify
        bonus_row = len(tokens) - 1
        j = 0
        while j < len(drafts) and drafts[j] == int(argmax[bonus_row + j]):
            accepted[j] += 1
            j += 1
        rounds += 1
        tokens = tokens + drafts[:j] + [int(argmax[bonus_row + j])]
        if eos in tokens[len(prompt):]:
            tokens = tokens[: tokens.index(eos, len(prompt)) + 1]
    return tokens[len(prompt):][:max_new], Acceptance(rounds, tuple(accepted))


@torch.no_grad()
def greedy_generate(model: TargetWithMTP, prompt: list[int], max_new: int, eos: int
                    ) -> list[int]:
    """Plain greedy decoding (full recompute per token): the reference output."""
    generated: list[int] = []
    while len(generated) < max_new and eos not in generated:
        generated.append(int(_target_forward(model, prompt + generated)[1][-1]))
    return generated


@torch.no_grad()
def simulate_rounds(target: TargetModel, draft: MTPDraftModel, prompts: list[list[int]],
                    num_steps: int, max_new: int, chain: bool = True) -> Acceptance:
    """The offline simulation an engine's acceptance must equal (DESIGN 3.5): greedy
    self-speculation at K = `num_steps` where every round drafts from scratch over the
    committed prefix (dense target forwards, no cache), no EOS, `max_new` tokens each.
    Step k uses module (k-1) mod L and reads g[k-1] (chain) or h."""
    device = target.lm_head.weight.device
    rounds, accepted = 0, [0] * num_steps

    def forward(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(tokens, device=device)
        hidden = target(ids, torch.arange(len(tokens), device=device),
                        DenseCausal(1, len(tokens)))
        return hidden, target.logits(hidden).argmax(-1)

    for prompt in prompts:
        hidden, argmax = forward(prompt)
        tokens = prompt + [int(argmax[-1])]
        while len(tokens) - len(prompt) < max_new:
            drafts = _drafts(draft, tokens, hidden, num_steps, chain)
            hidden, argmax = forward(tokens + drafts)
            bonus_row, j = len(tokens) - 1, 0
            while j < num_steps and drafts[j] == int(argmax[bonus_row + j]):
                accepted[j] += 1
                j += 1
            rounds += 1
            tokens = tokens + drafts[:j] + [int(argmax[bonus_row + j])]
    return Acceptance(rounds, tuple(accepted))


def _drafts(draft: MTPDraftModel, tokens: list[int], hidden: torch.Tensor, num_steps: int,
            chain: bool) -> list[int]:
    rows = len(tokens) - 1
    positions = torch.arange(rows, device=hidden.device)
    backend = DenseCausal(1, rows)
    h = prev = hidden[:rows]
    drafts: list[int] = []
    for k in range(1, num_steps + 1):
        inputs = torch.tensor((tokens + drafts)[k: k + rows], device=hidden.device)
        g = draft.step(k, inputs, prev, positions, backend)  # [rows, H]
        drafts.append(int(draft.logits(k, g[-1:]).argmax(-1)))
        prev = draft.next_input(k, g, h, chain)
    return drafts


def simulate(model: TargetWithMTP, prompts: list[list[int]], max_new: int, eos: int
             ) -> Acceptance:
    rounds, accepted = 0, [0] * model.num_mtp
    for prompt in prompts:
        _, acc = self_speculate(model, prompt, max_new, eos)
        rounds += acc.rounds
        accepted = [a + b for a, b in zip(accepted, acc.accepted, strict=True)]
    return Acceptance(rounds, tuple(accepted))


def held_out_prompts(docs: list[list[int]], count: int, length: int, eos: int, seed: int
                     ) -> list[list[int]]:
    """`count` prompts: EOS + `length - 1` tokens at a seeded offset of a held-out file
    (files taken in turn, longest first, so prompts come from different files)."""
    gen = torch.Generator().manual_seed(seed)
    usable = sorted((d for d in docs if len(d) >= length), key=len, reverse=True)
    if not usable:
        raise ValueError(f"no held-out file has {length} tokens")
    prompts = []
    for i in range(count):
        doc = usable[i % len(usable)]
        start = int(torch.randint(0, len(doc) - length + 2, (1,), generator=gen))
        prompts.append([eos] + doc[start: start + length - 1])
    return prompts

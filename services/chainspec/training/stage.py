"""One optimisation stage: AdamW over a parameter set, warmup + cosine, logged rows."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chainspec.training.batches import WindowSampler
from chainspec.training.demo_model import DemoModel
from chainspec.training.objective import Forward, run_model
from chainspec.training.recipe import StageSchedule

LossFn = Callable[[Forward, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class LogRow:
    stage: str
    step: int  # global step (stages continue the count)
    split: str  # "train" (mean over the last log interval) or "held-out"
    elapsed_s: float
    metrics: dict[str, float]


def lr_at(schedule: StageSchedule, step: int) -> float:
    """step is 1-based. Linear warmup, then cosine from lr to lr * min_lr_ratio."""
    if step <= schedule.warmup_steps:
        return schedule.lr * step / max(schedule.warmup_steps, 1)
    span = max(schedule.steps - schedule.warmup_steps, 1)
    progress = min((step - schedule.warmup_steps) / span, 1.0)
    floor = schedule.lr * schedule.min_lr_ratio
    return floor + (schedule.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(params: list[torch.nn.Parameter], schedule: StageSchedule
                   ) -> torch.optim.AdamW:
    """Weight decay on matrices only (not on norm weights)."""
    unique = list({id(p): p for p in params}.values())
    groups = [{"params": [p for p in unique if p.dim() >= 2],
               "weight_decay": schedule.weight_decay},
              {"params": [p for p in unique if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=schedule.lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass
class Stage:
    name: str
    schedule: StageSchedule
    params: list[torch.nn.Parameter]
    loss_fn: LossFn
    grad_target: bool  # False: the target runs without autograd (frozen)

    def run(self, model: DemoModel, sampler: WindowSampler, first_step: int, log_every: int,
            started: float) -> list[LogRow]:
        opt = make_optimizer(self.params, self.schedule)
        rows: list[LogRow] = []
        window: list[dict[str, float]] = []
        model.train()
        for step in range(1, self.schedule.steps + 1):
            for group in opt.param_groups:
                group["lr"] = lr_at(self.schedule, step)
            ids = sampler.next()  # [B, T]
            loss, metrics = self.loss_fn(run_model(model, ids, self.grad_target), ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.schedule.grad_clip)
            opt.step()
            window.append(metrics)
            if step % log_every == 0 or step == self.schedule.steps:
                rows.append(self._row(first_step + step, window, started))
                window = []
        return rows

    def _row(self, step: int, window: list[dict[str, float]], started: float) -> LogRow:
        mean = {k: sum(m[k] for m in window) / len(window) for k in window[0]}
        row = LogRow(self.name, step, "train", time.monotonic() - started, mean)
        shown = " ".join(f"{k}={v:.3f}" for k, v in mean.items())
        print(f"[{self.name}] step {step} t={row.elapsed_s:.0f}s {shown}", flush=True)
        return row

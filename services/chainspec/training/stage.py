"""One optimisation stage: AdamW over a parameter set, warmup + cosine, gradient
accumulation, optional autocast, logged rows, and resumption at any step.

Every stage of both trainers (the demo's joint and distill stages, `chainspec train-mtp`)
runs this one loop. A step draws `grad_accum` batches from the sampler, so a run resumed
from `StageState` at step s draws the same batches as an uninterrupted run after step s.
With a `parallel` hook (`data_parallel.DataParallel`) the same loop runs on every rank of
a data parallel group: forward through DDP, gradients averaged on each step's last batch,
metrics averaged over the ranks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from chainspec.training.batches import WindowSampler
from chainspec.training.mtp_model import TargetWithMTP
from chainspec.training.objective import Forward, run_model
from chainspec.training.recipe import StageSchedule

if TYPE_CHECKING:
    from chainspec.training.data_parallel import DataParallel

LossFn = Callable[[Forward, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class LogRow:
    stage: str
    step: int  # global step (stages continue the count)
    split: str  # "train" (mean over the last log interval) or "held-out"
    elapsed_s: float
    metrics: dict[str, float]


@dataclass
class StageState:
    """Where a stage stands after `step` of its steps: what a checkpoint must restore
    (besides the trained parameters themselves)."""

    step: int
    optimizer: dict
    sampler: torch.Tensor  # the sampler generator's state
    rows: list[LogRow] = field(default_factory=list)


# Called after every step with the step's metrics and the state to checkpoint from.
StepHook = Callable[[int, dict[str, float], Callable[[], StageState]], None]


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
    grad_accum: int = 1  # batches per optimizer step
    autocast: torch.dtype | None = None  # e.g. torch.bfloat16 on a GPU
    parallel: DataParallel | None = None  # this rank's data parallel group, if any

    def run(self, model: TargetWithMTP, sampler: WindowSampler, first_step: int,
            log_every: int, started: float, resume: StageState | None = None,
            on_step: StepHook | None = None) -> list[LogRow]:
        opt = make_optimizer(self.params, self.schedule)
        rows: list[LogRow] = []
        done = 0
        if resume is not None:
            opt.load_state_dict(resume.optimizer)
            sampler.generator.set_state(resume.sampler)
            rows, done = list(resume.rows), resume.step
        window: list[dict[str, float]] = []
        model.train()
        for step in range(done + 1, self.schedule.steps + 1):
            metrics = self._step(model, sampler, opt, step)
            window.append(metrics)
            if step % log_every == 0 or step == self.schedule.steps:
                rows.append(self._row(first_step + step, window, started))
                window = []
            if on_step is not None:
                on_step(step, metrics, lambda s=step: StageState(
                    s, opt.state_dict(), sampler.generator.get_state(), list(rows)))
        return rows

    def _step(self, model: TargetWithMTP, sampler: WindowSampler,
              opt: torch.optim.Optimizer, step: int) -> dict[str, float]:
        for group in opt.param_groups:
            group["lr"] = lr_at(self.schedule, step)
        opt.zero_grad(set_to_none=True)
        parts, dp = [], self.parallel
        for i in range(self.grad_accum):
            ids = sampler.next().to(model.device)  # [B, T] (this rank's share)
            last = i == self.grad_accum - 1
            with dp.accumulating(last) if dp else contextlib.nullcontext():
                with torch.autocast(ids.device.type, self.autocast or torch.bfloat16,
                                    enabled=self.autocast is not None):
                    fwd = dp.forward(ids) if dp else run_model(model, ids, self.grad_target)
                    loss, metrics = self.loss_fn(fwd, ids)
                (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()
            parts.append(metrics)
        torch.nn.utils.clip_grad_norm_(self.params, self.schedule.grad_clip)
        opt.step()
        return dp.mean_metrics(mean_metrics(parts)) if dp else mean_metrics(parts)

    def _row(self, step: int, window: list[dict[str, float]], started: float) -> LogRow:
        mean = mean_metrics(window)
        row = LogRow(self.name, step, "train", time.monotonic() - started, mean)
        shown = " ".join(f"{k}={v:.3f}" for k, v in mean.items())
        if self.parallel is None or self.parallel.is_main:
            print(f"[{self.name}] step {step} t={row.elapsed_s:.0f}s {shown}", flush=True)
        return row


def mean_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    return {k: sum(m[k] for m in parts) / len(parts) for k in parts[0]}

"""Data parallel distill training: DDP over the MTP modules only, one rank per process.

Every rank holds the whole frozen target (loaded by itself, never broadcast, no
gradients) and a replica of the modules; DDP averages the modules' gradients, once per
optimizer step (the accumulation batches before the last run under `no_sync`). The
process group must exist (Ray Train's `TorchTrainer` sets it up: gloo on CPU, NCCL on
GPUs). `Stage` takes an instance as its `parallel` hook; the loop itself is unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from chainspec.training.mtp_model import TargetWithMTP
from chainspec.training.objective import Forward, run_model


class _ModelForward(nn.Module):
    """run_model as a module forward, so DDP sees (and hooks) each forward pass."""

    def __init__(self, model: TargetWithMTP) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> Forward:
        return run_model(self.model, ids, grad_target=False)


class DataParallel:
    def __init__(self, model: TargetWithMTP) -> None:
        if any(p.requires_grad for p in model.target.parameters()):
            raise ValueError("data parallel training needs a frozen target")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        wrapper = _ModelForward(model)
        trained = {f"model.draft.mtp.{n}" for n, _ in model.draft.mtp.named_parameters()}
        names = [n for n, _ in wrapper.named_parameters()]
        names += [n for n, _ in wrapper.named_buffers()]
        # NOTE: everything but the modules (the target, shared embedding/head, rotary
        # tables) is left out of DDP: never broadcast at construction, never reduced.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            wrapper, [n for n in names if n not in trained])
        device = model.device
        self.ddp = DistributedDataParallel(
            wrapper, device_ids=[device.index] if device.type == "cuda" else None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def forward(self, ids: torch.Tensor) -> Forward:
        return self.ddp(ids)

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a batch's forward and backward: gradients are averaged over the ranks
        only on the step's last batch."""
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics averaged over the ranks (every rank logs the global mean)."""
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            values = values.to(self.ddp.module.model.device)
        dist.all_reduce(values)
        return dict(zip(keys, (values / self.world).tolist(), strict=True))

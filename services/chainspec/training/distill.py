"""The distill stage: train only the MTP modules against the frozen target's own
next-token distributions (soft cross-entropy, `objective.distill_loss`).

The one path both trainers take: the demo trainer's second stage and the whole of
`chainspec train-mtp` build their stage here.
"""

from __future__ import annotations

import torch

from chainspec.training.mtp_model import TargetWithMTP
from chainspec.training.objective import distill_loss
from chainspec.training.recipe import StageSchedule
from chainspec.training.stage import Stage


def freeze_target(model: TargetWithMTP) -> None:
    """No gradient reaches the target, nor the embedding and head it shares."""
    model.target.requires_grad_(False)


def distill_stage(model: TargetWithMTP, schedule: StageSchedule, grad_accum: int = 1,
                  autocast: torch.dtype | None = None, data_parallel: bool = False) -> Stage:
    """data_parallel: this process is one rank of an initialised torch.distributed group
    (`data_parallel.DataParallel`)."""
    freeze_target(model)
    parallel = None
    if data_parallel:
        from chainspec.training.data_parallel import DataParallel
        parallel = DataParallel(model)
    return Stage("distill", schedule, model.mtp_parameters(), distill_loss,
                 grad_target=False, grad_accum=grad_accum, autocast=autocast,
                 parallel=parallel)

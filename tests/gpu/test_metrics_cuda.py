"""GPU-only: the drafter's metrics on CUDA. Steady-state rounds replay a captured graph
(counted as replays, no per-step times: a graph has no host marks); a long first window
runs eagerly with K per-step times from CUDA events. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from chainspec.engine.draft_types import SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.step_clock import StepClock
from chainspec.metrics.drafter import DrafterMetrics
from tests.unit.tiny_models import tiny_draft_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none visible to torch)")
K = 3
CUDA = torch.device("cuda")


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_step_clock_times_cuda_work():
    clock = StepClock(CUDA)
    x = torch.randn(512, 512, device=CUDA)
    clock.mark()
    for _ in range(K):
        x = x @ x
        clock.mark()
    x.cpu()  # the round's own sync
    got = clock.durations()
    assert len(got) == K and all(d > 0 for d in got)


def test_drafter_metrics_on_cuda_graphs():
    model = tiny_draft_model(2).to(CUDA)
    metrics = DrafterMetrics("m", K)
    engine = DrafterEngine(model, DrafterConfig(num_steps=K, max_seqs=4, max_len=64),
                           observer=metrics)
    hidden = model.config.hidden_size
    engine.update([SeqUpdate(1, 0, tuple(range(1, 10)), torch.zeros(9, hidden))])  # long
    for i in range(3):  # steady state: one row per update fits a captured bucket
        engine.update([SeqUpdate(1, 9 + i, (5,), torch.zeros(1, hidden))])
    assert value(metrics, "chainspec_drafter_eager_runs_total", reason="window_too_large") == 1
    assert value(metrics, "chainspec_drafter_graph_replays_total") == 3
    for step in range(1, K + 1):  # only the eager round has per-step times
        assert value(metrics, "chainspec_drafter_step_seconds_count", step=str(step)) == 1
    assert value(metrics, "chainspec_drafter_round_seconds_count") == 4

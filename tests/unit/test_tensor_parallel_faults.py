"""A lost rank cannot hang its group (DESIGN 4.10): SIGKILL (or SIGSTOP: hung) rank 1 of a TP=2
group on CPU and rank 0's next step raises within the collective timeout instead of waiting forever;
a group whose ranks are alive serves again afterwards (a fresh group)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from chainspec.engine.local import DEMO_MODEL
from chainspec.engine.tp_launch import start_local_group
from chainspec.models.attention import DenseCausal

TIMEOUT_S = 3.0


def _step(leader) -> torch.Tensor:
    ids = torch.arange(1, 9)
    with torch.inference_mode():
        return leader.logits(leader(ids, torch.arange(8), DenseCausal(1, 8,
                                                                      leader.attention_scale)))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_rank_fails_the_step_within_the_timeout(sig):
    group = start_local_group(DEMO_MODEL, 2, cache_len=64, collective_timeout_s=TIMEOUT_S)
    rank1 = group.processes[0]
    try:
        before = _step(group.leader)
        os.kill(rank1.pid, sig)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            _step(group.leader)
        assert time.monotonic() - t0 < TIMEOUT_S + 5
    finally:
        if sig == signal.SIGSTOP:
            rank1.kill()
        group.close()
    again = start_local_group(DEMO_MODEL, 2, cache_len=64, collective_timeout_s=TIMEOUT_S)
    try:
        torch.testing.assert_close(_step(again.leader), before)
    finally:
        again.close()


def test_an_idle_group_stays_alive_past_the_idle_timeout():
    """Rank 0's keep-alive pings the followers, whose wait for the next command would
    otherwise time out after `idle_timeout_s` and end the group."""
    group = start_local_group(DEMO_MODEL, 2, cache_len=64, idle_timeout_s=2.0)
    try:
        before = _step(group.leader)
        time.sleep(5.0)  # 2.5 idle timeouts
        assert group.processes[0].is_alive()
        torch.testing.assert_close(_step(group.leader), before)
    finally:
        group.close()

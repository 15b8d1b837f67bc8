"""An idle TP group notices a hung rank (issue 22 item 4): rank 0's heartbeat, sent while
no step runs, must be answered by every rank within the step timeout. SIGSTOP rank 1 of
an idle TP=2 group on CPU: within heartbeat + timeout the channel names rank 1 as
unresponsive, and the next step fails at once instead of after another timeout. A healthy
idle group answers every heartbeat and serves on."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from chainspec.engine.local import DEMO_MODEL
from chainspec.engine.tp_launch import start_local_group
from chainspec.models.attention import DenseCausal

TIMEOUT_S, HEARTBEAT_S = 4.0, 0.5


def _step(leader) -> torch.Tensor:
    ids = torch.arange(1, 9)
    with torch.inference_mode():
        return leader.logits(leader(ids, torch.arange(8), DenseCausal(1, 8,
                                                                      leader.attention_scale)))


@pytest.fixture
def group():
    group = start_local_group(DEMO_MODEL, 2, cache_len=64, collective_timeout_s=TIMEOUT_S,
                              heartbeat_s=HEARTBEAT_S)
    yield group
    group.close()


def test_a_hung_rank_of_an_idle_group_fails_it_within_heartbeat_and_timeout(group):
    channel = group.leader.channel
    _step(group.leader)
    os.kill(group.processes[0].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    while channel.failure is None and time.monotonic() - stopped < 3 * (TIMEOUT_S + 1):
        time.sleep(0.05)
    took = time.monotonic() - stopped
    assert channel.failure is not None, "the hung rank went unnoticed"
    assert took < HEARTBEAT_S + TIMEOUT_S + 1.5, took
    assert channel.unresponsive == {1} and "[1]" in channel.failure
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer the heartbeat"):
        _step(group.leader)
    assert time.monotonic() - t0 < 0.5  # no second timeout
    group.processes[0].kill()  # the hung rank (a member restarts its group as a unit)


def test_a_healthy_idle_group_answers_every_heartbeat(group):
    channel = group.leader.channel
    before = _step(group.leader)
    time.sleep(6 * HEARTBEAT_S)
    assert channel.failure is None and channel.heartbeats >= 3
    torch.testing.assert_close(_step(group.leader), before)

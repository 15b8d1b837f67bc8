"""A hung rank of an IDLE TP=2 verifier member (issue 22 item 4, on real Ray): SIGSTOP
rank 1 while no request runs. Rank 0's heartbeat goes unanswered, so within the
heartbeat interval + the collective timeout (+ the controller's ping) the member turns
not ready with an error naming the hung rank -- not at the next request -- and the group
restarts as a unit (both ranks new processes) and serves output equal to plain."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from chainspec.cluster import stack
from chainspec.cluster.config import DrafterRoleConfig, RoleConfig, StackConfig
from chainspec.engine.tp_channel import HEARTBEAT_S
from tests.integration.helpers import (
    generate,
    plain_outputs,
    prompt_ids,
    ready_tp_verifier,
    stack_verifier,
    verifier_stub,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)
NS = "chainspec-tp-idle-hang-test"
COLLECTIVE_TIMEOUT_S = 4.0
PING_S = 0.5


def test_an_idle_member_with_a_hung_rank_turns_not_ready_and_restarts(ray_cluster,
                                                                      model_dir) -> None:
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=4, max_len=256,
                         health_interval_s=PING_S, health_timeout_s=3.0, namespace=NS,
                         drafter=DrafterRoleConfig(mode="local", replicas=0),
                         verifier=RoleConfig(tensor_parallel_size=2,
                                             collective_timeout_s=COLLECTIVE_TIMEOUT_S))
    prompts = prompt_ids(model_dir, 2)
    plain = plain_outputs(model_dir, prompts, max_tokens=16)
    stack.up(config)
    hung = None
    try:
        before = ready_tp_verifier(NS)
        hung = before["ranks"][1]["pid"]
        time.sleep(2 * HEARTBEAT_S)  # idle: heartbeats answered, still ready
        assert stack_verifier(NS)["state"] == "ready"
        os.kill(hung, signal.SIGSTOP)
        stopped = time.monotonic()
        down = wait_for(lambda: (v := stack_verifier(NS))["state"] != "ready" and v,
                        3 * (HEARTBEAT_S + COLLECTIVE_TIMEOUT_S), "the member not ready")
        took = time.monotonic() - stopped
        print(f"not ready {took:.1f}s after SIGSTOP (bound "
              f"{HEARTBEAT_S + COLLECTIVE_TIMEOUT_S + 2 * PING_S + 1:.1f}s): {down['error']}")
        assert took < HEARTBEAT_S + COLLECTIVE_TIMEOUT_S + 2 * PING_S + 1
        assert "[1]" in (down["error"] or "") and "hung" in down["error"]

        back = ready_tp_verifier(NS, pids_not=frozenset(r["pid"] for r in before["ranks"]))
        assert back["member_id"] == before["member_id"] and back["restarts"] >= 1
        channel, stub = verifier_stub(back["endpoint"])
        try:
            assert [generate(stub, p, 16, timeout=60).tokens for p in prompts] == plain
        finally:
            channel.close()
    finally:
        if hung is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGKILL)
        stack.down(namespace=NS)

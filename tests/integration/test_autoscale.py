"""Drafter autoscaling on the session's real local Ray (issue 14): a load step from 1 to 24
concurrent streams raises drafters from 1 to >= 2 within a bound; a SIGKILLed controller
comes back with the policy and the last decision; idle brings drafters back to the minimum
through drain; no request fails and every output equals plain greedy decoding throughout.
The drafter timeline is sampled all along and plotted with the benchmark's plot.

The policy is driven by occupancy here (drafter capacity 4 at target 0.75: 3 sequences
per drafter); its draft-wait thresholds are set out of reach, because draft waits on two
shared CPU cores are noise. The draft-wait rule is tested on a fake clock
(tests/unit/test_autoscale_policy.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from chainspec.benchserve import plots
from chainspec.cluster import stack
from chainspec.cluster.autoscale import AutoscalePolicy
from chainspec.cluster.config import DrafterRoleConfig, StackConfig
from tests.integration.helpers import (
    LoadGenerator,
    plain_outputs,
    prompt_ids,
    verifier_stub,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)
NS = "chainspec-autoscale"
STREAMS, TOKENS = 24, 32
SCALE_OUT_S = 60.0  # load step -> a second drafter serving (decision ~1 s + actor start)
SCALE_IN_S = 60.0  # idle -> back to the minimum (down window 4 s + cooldown + drain)
POLICY = AutoscalePolicy(min_drafters=1, max_drafters=3, target_occupancy=0.75,
                         draft_wait_high_s=10.0, draft_wait_low_s=5.0, up_window_s=1.0,
                         down_window_s=4.0, cooldown_s=2.0, interval_s=0.25)


class Timeline:
    """(seconds, drafters serving) every 0.5 s from a thread, as `bench serve` records."""

    def __init__(self) -> None:
        self.t0, self.samples = time.monotonic(), []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                n = len(drafters())
            except Exception:  # the controller restarting: no sample
                continue
            self.samples.append((round(time.monotonic() - self.t0, 2), n))

    def stop(self) -> list[tuple[float, int]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.samples


def drafters(state: str = "ready") -> list[dict]:
    return [m for m in stack.status(namespace=NS)
            if m["role"] == "drafter" and (state is None or m["state"] == state)]


def autoscale() -> dict:
    return stack.autoscale_state(namespace=NS)


def controller_pid() -> int | None:
    try:
        return ray.get(stack.connect(namespace=NS).ping.remote(), timeout=2)["pid"]
    except Exception:  # restarting
        return None


def decisions(url: str) -> dict[str, float]:
    """direction -> decisions counted by this controller process."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "chainspec_drafter_autoscale_decisions_total":
                out[s.labels["direction"]] = out.get(s.labels["direction"], 0) + s.value
    return out


@pytest.fixture(scope="module")
def up(ray_cluster, model_dir):
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=STREAMS,
                         drafter_max_seqs=4, max_len=256, health_interval_s=0.5,
                         health_timeout_s=3.0, drain_timeout_s=20.0, namespace=NS,
                         drafter=DrafterRoleConfig(autoscale=POLICY))
    stack.up(config)
    yield config
    try:
        stack.down(namespace=NS)
    except stack.StackNotFound:
        pass


@pytest.fixture(scope="module")
def prompts(model_dir):
    return prompt_ids(model_dir, STREAMS)


@pytest.fixture(scope="module")
def plain(model_dir, prompts):
    return plain_outputs(model_dir, prompts, TOKENS)


def test_load_step_scales_out_restart_keeps_policy_idle_drains_back(up, prompts, plain,
                                                                   tmp_path) -> None:
    state = autoscale()
    assert state["policy"] == POLICY.to_dict() and state["desired"] == 1
    assert state["last_decision"] is None and len(drafters()) == 1
    verifier = [m for m in stack.status(namespace=NS) if m["role"] == "verifier"][0]
    channel, stub = verifier_stub(verifier["endpoint"])
    timeline = Timeline()
    try:
        # one stream: 1 sequence never needs a second drafter
        one = LoadGenerator(stub, prompts, plain, max_tokens=TOKENS, workers=1)
        time.sleep(3.0)
        one.stop()
        assert autoscale()["last_decision"] is None and len(drafters(None)) == 1
        assert one.done > 0 and one.failures == []

        # the load step: 24 streams
        t_step = time.monotonic()
        load = LoadGenerator(stub, prompts, plain, max_tokens=TOKENS, workers=STREAMS)
        try:
            wait_for(lambda: len(drafters()) >= 2, SCALE_OUT_S, "a second drafter serving")
            scaled_out_s = time.monotonic() - t_step
            up_decision = autoscale()["last_decision"]
            assert up_decision["direction"] == "up" and up_decision["before"] == 1
            assert up_decision["kind"] == "occupancy" and up_decision["after"] >= 2
            assert up_decision["signals"]["sequences"] > 3
            metrics_url = autoscale()["metrics_url"]
            assert decisions(metrics_url)["up"] >= 1

            # the controller dies under load: policy and decision come back from GCS
            old_pid = controller_pid()
            os.kill(old_pid, signal.SIGKILL)
            wait_for(lambda: controller_pid() not in (None, old_pid), 30.0,
                     "a restarted controller")
            after = autoscale()
            assert after["policy"] == POLICY.to_dict()
            assert after["last_decision"] == up_decision or \
                after["last_decision"]["time"] > up_decision["time"]  # or a newer one
            time.sleep(2.0)  # requests keep flowing across the restart
        finally:
            load.stop()
        done_under_load = load.done

        # idle: back to the minimum, through drain
        t_idle = time.monotonic()
        wait_for(lambda: autoscale()["desired"] == 1 and len(drafters(None)) == 1,
                 SCALE_IN_S, "drafters drained back to 1")
        scaled_in_s = time.monotonic() - t_idle
        last = autoscale()["last_decision"]
        assert (last["direction"], last["after"], last["kind"]) == ("down", 1, "occupancy")
        assert decisions(autoscale()["metrics_url"]).get("down", 0) >= 1

        # still lossless with the one remaining drafter
        final = LoadGenerator(stub, prompts[:4], plain[:4], max_tokens=TOKENS, workers=2)
        wait_for(lambda: final.done >= 4, 60.0, "requests after the scale-in")
        final.stop()
    finally:
        samples = timeline.stop()
        channel.close()
    print(f"scaled out in {scaled_out_s:.1f} s, back to 1 in {scaled_in_s:.1f} s, "
          f"{done_under_load} requests under load; timeline {samples}")
    assert load.failures == [] and final.failures == [] and done_under_load > STREAMS
    assert max(n for _, n in samples) >= 2 and samples[-1][1] == 1
    step = {"t_start_s": t_step - timeline.t0, "t_end_s": t_idle - timeline.t0}
    png = plots.drafters_png({"drafters_over_time": samples, "runs": {"spec": [step]}},
                             tmp_path / "drafters.png")
    assert png.stat().st_size > 0


def status_json() -> dict:
    out = subprocess.run([sys.executable, "-m", "chainspec.cli", "status", "--json",
                          "--namespace", NS], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_new_bounds_apply_at_once_and_a_fixed_count_ends_autoscaling(up) -> None:
    """`scale drafters auto:2-2` moves the count to the new bounds (kind `bounds`), keeping
    the stack's other policy fields; `scale drafters 1` turns autoscaling off; `status
    --json` from another process shows the policy and the last decision."""
    state = stack.set_autoscale({"min_drafters": 2, "max_drafters": 2}, namespace=NS)
    assert state["policy"] == {**POLICY.to_dict(), "min_drafters": 2, "max_drafters": 2}
    wait_for(lambda: len(drafters()) == 2, SCALE_OUT_S, "the drafters at the new minimum")
    shown = status_json()["autoscale"]
    assert shown["policy"]["min_drafters"] == 2 and shown["desired"] == 2
    assert (shown["last_decision"]["kind"], shown["last_decision"]["after"]) == ("bounds", 2)
    stack.scale("drafter", 1, namespace=NS)
    assert autoscale()["policy"] is None and len(drafters(None)) == 1
    time.sleep(4 * POLICY.interval_s)  # no autoscaler acts any more
    assert status_json()["autoscale"]["policy"] is None and len(drafters(None)) == 1
    with pytest.raises(stack.StackError, match="min_drafters <= max_drafters"):
        stack.set_autoscale({"min_drafters": 3, "max_drafters": 2}, namespace=NS)

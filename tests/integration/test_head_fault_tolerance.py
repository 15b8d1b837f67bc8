"""The head survives its GCS (DESIGN 4.10, issue 22 item 6): `chainspec serve` on an
embedded local Ray whose GCS keeps its tables in a real `redis-server` (Ray's own
`RAY_REDIS_ADDRESS`, what KubeRay's `gcsFaultToleranceOptions` sets on the head). Under
16 HTTP streams the GCS process is SIGKILLed and started again on the same port (what a
restarted head pod does; Ray's local mode has no supervisor that would): no request is
lost or changed, the members and the scaled drafter count are the ones from before, and
`status`, `scale` and the drafter autoscaler work through the new GCS, and the gateway's
own Ray session (the serve process) stops the stack through it at the end.

Its own Redis, namespace, state dir and Ray (in the serve process); it joins no Ray it
did not start, and stops what it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from chainspec.models.tokenizer import Tokenizer
from tests import tools
from tests.integration import helpers
from tests.integration.helpers import plain_outputs, prompt_ids

pytestmark = pytest.mark.timeout(240)
NS = "chainspec-gcs-ft-test"
TOKENS = 48
STREAMS = 16
OUTAGE_S = 3.0  # the GCS is gone this long (Ray's clients wait up to 60 s for it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """A redis-server of our own on a free port; its address."""
    binary = tools.redis_server()
    port, data = free_port(), tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    helpers.wait_for(lambda: _answers(port), 20, "redis-server answering")
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def env(redis):
    state = tempfile.mkdtemp(prefix="chainspec-gcs-ft-")
    out = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    return {**out, "RAY_REDIS_ADDRESS": redis, "CHAINSPEC_STATE_DIR": state,
            "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def served(env, model_dir):
    """`chainspec serve` hosting its own Ray (no --address) with GCS fault tolerance."""
    port = free_port()
    proc = helpers.Process([sys.executable, "-m", "chainspec.cli", "serve", "--model",
                            str(model_dir), "--namespace", NS, "--port", str(port),
                            "--max-len", "256", "--max-seqs", "16", "--timeout", "180"], env)
    proc.url, proc.state_dir = f"http://127.0.0.1:{port}", env["CHAINSPEC_STATE_DIR"]
    restarted: list[subprocess.Popen] = []
    proc.restarted = restarted
    try:
        proc.wait_for("Ctrl-C stops it.", 180)
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGTERM)
        try:
            proc.proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
        for gcs in restarted:  # ours: the owner's shutdown only knows the first GCS
            gcs.kill()
            gcs.wait(10)


def cli(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chainspec.cli", *args, "--namespace", NS],
                          capture_output=True, text=True, timeout=120, env=env)


def status(env) -> dict:
    r = cli(env, "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def ready(snapshot: dict, role: str) -> list[str]:
    """The ready members of `role` in one `status --json` (NOTE: each `status` is a
    fresh CLI process that joins Ray, ~3 s: one per check, not one per role)."""
    return sorted(m["member_id"] for m in snapshot["members"]
                  if m["role"] == role and m["state"] == "ready")


def drained_to_one(env) -> dict | None:
    """The status once a single drafter is left and ready, else None."""
    now = status(env)
    drafters = [m for m in now["members"] if m["role"] == "drafter"]
    return now if len(drafters) == 1 and len(ready(now, "drafter")) == 1 else None


class Streams:
    """STREAMS threads streaming greedy completions until stopped; each text is checked
    against plain decoding, and each request's (start, end) is kept."""

    def __init__(self, url: str, prompts, expected) -> None:
        self.url, self.prompts, self.expected = url, prompts, expected
        self.spans: list[tuple[float, float]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True)
                         for i in range(STREAMS)]
        for t in self._threads:
            t.start()

    def _work(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                k = i % len(self.prompts)
                start = time.monotonic()
                try:
                    text = self._stream(client, self.prompts[k])
                    problem = None if text == self.expected[k] else f"prompt {k}: differs"
                except Exception as e:  # any lost request is a failure
                    problem = f"prompt {k}: {type(e).__name__}: {e}"
                self.spans.append((start, time.monotonic()))
                if problem:
                    self.failures.append(problem)

    def _stream(self, client: httpx.Client, prompt) -> str:
        body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text = []
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text.append(chunk["choices"][0]["text"])
        return "".join(text)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


def kill_gcs(served) -> tuple[list[str], str]:
    """SIGKILL the serve process's GCS; its command line with its own port, and its cwd."""
    gcs = [p for p in psutil.Process(served.proc.pid).children(recursive=True)
           if p.name() == "gcs_server"]
    assert len(gcs) == 1, gcs
    state = Path(served.state_dir) / f"stack-{NS}.json"
    port = json.loads(state.read_text())["address"].rsplit(":", 1)[1]
    # NOTE: the embedded head picks a free GCS port (--gcs_server_port=0); the clients
    # reconnect to the address they know, so it comes back there
    argv = [f"--gcs_server_port={port}" if a.startswith("--gcs_server_port=") else a
            for a in gcs[0].cmdline()]
    cwd = gcs[0].cwd()
    gcs[0].send_signal(signal.SIGKILL)
    helpers.wait_for(lambda: _gone(gcs[0]), 10, "the GCS gone")  # a zombie until reaped
    return argv, cwd


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_gcs_restart_under_load_loses_nothing(served, env, model_dir) -> None:
    r = cli(env, "scale", "drafters", "2")
    assert r.returncode == 0, r.stderr
    before = status(env)
    drafters, verifiers = ready(before, "drafter"), ready(before, "verifier")
    assert len(drafters) == 2 and len(verifiers) == 1, before

    tok = Tokenizer.from_dir(model_dir)
    prompts = prompt_ids(model_dir, 8)
    expected = [tok.decode(t) for t in plain_outputs(model_dir, prompts, TOKENS)]
    load = Streams(served.url, prompts, expected)
    try:
        helpers.wait_for(lambda: len(load.spans) >= STREAMS, 60, "every stream serving")
        argv, cwd = kill_gcs(served)
        killed_at = time.monotonic()
        time.sleep(OUTAGE_S)
        served.restarted.append(subprocess.Popen(
            argv, cwd=cwd, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        back_at = time.monotonic()
        helpers.wait_for(lambda: len([s for s in load.spans if s[0] > back_at]) >= STREAMS,
                         60, "requests started after the restart completing")
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    at_kill = [s for s in load.spans if s[0] < killed_at < s[1]]
    in_outage = [s for s in load.spans if killed_at < s[0] < back_at]  # admitted, no GCS
    print(f"requests: {len(load.spans)}, in flight at the kill: {len(at_kill)}, started "
          f"while the GCS was down: {len(in_outage)}")
    assert len(at_kill) >= STREAMS // 2 and in_outage, (len(at_kill), len(in_outage))

    # the same members, not restarted ones, and the scaled count kept
    after = status(env)
    assert ready(after, "drafter") == drafters and ready(after, "verifier") == verifiers
    pids = {m["member_id"]: m["pid"] for m in before["members"]}
    assert {m["member_id"]: m["pid"] for m in after["members"]
            if m["member_id"] in pids} == pids
    assert after["autoscale"]["desired"] == 2
    assert [m["state"] for m in after["members"] if m["role"] == "gateway"] == ["ready"]

    # the controller acts through the new GCS: its autoscaler decides, the drain is done
    r = cli(env, "scale", "drafters", "auto:1-1")
    assert r.returncode == 0, r.stderr
    drained = helpers.wait_for(lambda: drained_to_one(env), 60,
                               "the autoscaler draining to one drafter")
    assert drained["autoscale"]["last_decision"]["after"] == 1  # stored before the drain

    # the gateway's own Ray session reconnected: its shutdown stops the stack through it
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(60) == 0, served.output()
    assert served.lines[-1].endswith("] stopped"), served.output()
    assert "no stack named" in cli(env, "status").stderr

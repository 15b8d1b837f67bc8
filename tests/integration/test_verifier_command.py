"""`chainspec verifier` as a real process routed to a `chainspec drafter` process: it serves
lossless speculative output, then drains and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.integration.helpers import generate, plain_outputs, prompt_ids, verifier_stub


def start(*argv: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "chainspec.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if " serving " not in line:
        proc.kill()
        raise AssertionError(f"{argv[0]} did not start: {line} {proc.stderr.read()[-3000:]}")
    return proc, line.split()[2]


def assert_serves_speculatively(address: str, model_dir) -> None:
    """Greedy output over gRPC equals plain decoding, with drafts accepted."""
    channel, stub = verifier_stub(address)
    prompts = prompt_ids(model_dir, 2)
    got = [generate(stub, p, 24) for p in prompts]
    channel.close()
    assert [g.tokens for g in got] == plain_outputs(model_dir, prompts, 24)
    assert sum(g.finished.stats.accepted_tokens for g in got) > 0


def test_verifier_process_with_a_drafter_process(model_dir) -> None:
    common = ["--model", str(model_dir), "-k", "3", "--max-len", "256"]
    drafter, drafter_address = start("drafter", *common)
    verifier = None
    try:
        verifier, address = start("verifier", *common, "--drafter", drafter_address)
        assert_serves_speculatively(address, model_dir)
        verifier.send_signal(signal.SIGTERM)
        assert verifier.wait(30) == 0
        assert "verifier draining" in verifier.stdout.read()
    finally:
        for proc in (verifier, drafter):
            if proc is not None:
                proc.kill()
                proc.wait(10)


def test_verifier_process_with_its_drafter_in_process(model_dir) -> None:
    """`--drafter-mode local`: no drafter service, drafts from the MTP modules in the
    verifier's own process, output equal to plain."""
    verifier, address = start("verifier", "--model", str(model_dir), "-k", "3",
                              "--max-len", "256", "--drafter-mode", "local")
    try:
        assert_serves_speculatively(address, model_dir)
    finally:
        verifier.kill()
        verifier.wait(10)

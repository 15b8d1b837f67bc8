"""The one signal-then-drain helper (commands/signals.py): a real process that gets SIGTERM
or SIGINT drains, then exits 0 -- blocking on the main thread (`until_stopped`: gateway,
up, serve) and on its event loop (`serve_until_signal`: drafter, verifier), and as the
real `chainspec gateway`; a failure exits 1 after the drain; and no command installs a
signal handler of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from chainspec.commands.signals import LOST, StopSignal, until_stopped

pytestmark = pytest.mark.timeout(60)
PACKAGE = Path(__file__).resolve().parents[2] / "services" / "chainspec"

BLOCKING = """
import sys, time
from chainspec.commands.signals import StopSignal, until_stopped
def drain(why):
    time.sleep(0.2)  # a drain that takes a while: the exit waits for it
    print("drained", why, flush=True)
stop = StopSignal()
stop.catch()
print("ready", flush=True)
sys.exit(until_stopped(drain, stop=stop))
"""

ON_LOOP = """
import asyncio, sys
from chainspec.commands.signals import serve_until_signal
async def drain():
    await asyncio.sleep(0.2)
    print("drained", flush=True)
async def main():
    # NOTE: runs once the wait has its handlers in
    asyncio.get_running_loop().call_soon(print, "ready")  # unbuffered: PYTHONUNBUFFERED
    return await serve_until_signal("svc", drain)
sys.exit(asyncio.run(main()))
"""


def run_until_signal(argv: list[str], sig: signal.Signals, ready: str) -> tuple[int, str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith(ready), line + proc.stdout.read()
        proc.send_signal(sig)
        code = proc.wait(30)
        return code, line + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_blocked_main_thread_drains_then_exits_zero(sig) -> None:
    code, out = run_until_signal([sys.executable, "-c", BLOCKING], sig, "ready")
    assert code == 0, out
    assert f"drained got {sig.name}" in out


def test_a_service_on_its_loop_drains_then_exits_zero() -> None:
    code, out = run_until_signal([sys.executable, "-c", ON_LOOP], signal.SIGTERM, "ready")
    assert code == 0, out
    assert out.splitlines()[1:] == ["svc draining", "drained", "svc stopped"]


def test_the_gateway_command_stops_on_sigterm_and_exits_zero() -> None:
    """The real command (routed to nowhere: it needs no model): serves, then SIGTERM."""
    argv = [sys.executable, "-m", "chainspec.cli", "gateway", "--verifier", "127.0.0.1:9",
            "--port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("gateway serving "), line + proc.stdout.read()
        url = line.split()[-1]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # no verifier
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stdout.read()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def own_handlers():
    """The waits below install handlers in this (pytest's) process: put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_lost_and_failed_end_the_wait_with_their_reason(own_handlers) -> None:
    lost, seen = threading.Event(), []
    threading.Timer(0.05, lost.set).start()
    assert until_stopped(seen.append, lost) == 0
    stop = StopSignal()
    threading.Timer(0.05, stop.fail, ("engine died",)).start()
    assert until_stopped(seen.append, stop=stop) == 1
    assert seen == [LOST, "engine died"]


def test_no_command_installs_its_own_signal_handlers() -> None:
    """A new foreground command must wait through commands/signals.py."""
    # NOTE: the template workers are child processes, not commands: they ignore SIGINT
    # (the gateway that started them handles it) and hold no handler of their own
    children = {"signals.py", "render_pool.py"}
    offenders = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                 if path.name not in children and any(
                     call in path.read_text() for call in ("signal.signal(",
                                                           "add_signal_handler("))]
    assert offenders == []


def test_the_first_reason_wins(own_handlers) -> None:
    stop = StopSignal()
    stop.stop("got SIGTERM")
    stop.fail("engine died")
    assert (stop.reason, stop.failed) == ("got SIGTERM", False)
    assert stop.wait() == "got SIGTERM"  # already stopped: no wait

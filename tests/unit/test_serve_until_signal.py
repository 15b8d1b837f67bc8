"""The service commands' run loop: a failure reason ends it with exit 1 after a drain
(a supervisor then restarts the process); without one it waits for a signal."""

from __future__ import annotations

import asyncio
import os
import signal

from chainspec.commands.signals import StopSignal, serve_until_signal


def test_a_failure_drains_and_exits_non_zero(capsys) -> None:
    drained = []

    async def main() -> int:
        stop = StopSignal()

        async def drain() -> None:
            drained.append(True)
        asyncio.get_running_loop().call_later(0.05, stop.fail, "engine died")
        return await serve_until_signal("verifier", drain, stop)
    assert asyncio.run(main()) == 1
    assert drained == [True]
    assert "verifier failed: engine died" in capsys.readouterr().err


def test_a_signal_drains_and_exits_zero() -> None:
    drained = []

    async def main() -> int:
        async def drain() -> None:
            drained.append(True)
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        return await serve_until_signal("drafter", drain)
    assert asyncio.run(main()) == 0
    assert drained == [True]

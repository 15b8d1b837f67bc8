"""Worker processes for work that might never end (a chat template is a program).

`RenderPool.call(job)` runs `fn(job)` in one of a few long-lived child processes and
awaits the answer off the event loop: a thread per worker sends the job over a socket
pair and waits for the reply with a time limit. Past the limit the worker is killed
(SIGKILL: a thread, or a Python-level alarm, cannot stop a C-level loop such as a huge
`**`) and a fresh one takes its place on the next call, so a runaway job costs one
worker for `timeout_s`, never the gateway's CPU or GIL. Each worker also caps its own
data segment (RLIMIT_DATA), so a job that builds huge values gets MemoryError instead of
growing the machine's memory.

The child is `python -c` importing only the module that holds `fn` (no `multiprocessing`
spawn, which would re-import the parent's `__main__`); it exits when its socket closes,
when its parent process is gone, or on the parent's death signal (Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 60.0  # a worker's interpreter start (imports), not counted in timeout_s
NICENESS = 10  # workers' scheduling priority below the gateway's


class RenderTimeout(Exception):
    """The job ran past the time limit; its worker was killed."""


class RenderFailed(Exception):
    """The job raised (`kind` = the exception's class name), or its worker died."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


class RenderPool:
    """`workers` processes running `fn` (a module-level function) one job at a time each;
    started on first use, killed by `close`."""

    def __init__(self, fn: Callable[[Any], Any], workers: int, timeout_s: float,
                 memory_bytes: int) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("RenderPool needs workers >= 1 and timeout_s > 0")
        self.timeout_s = timeout_s
        self._workers = [_Worker(f"{fn.__module__}:{fn.__qualname__}", memory_bytes)
                         for _ in range(workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for worker in self._workers:
            self._idle.put(worker)
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="render-pool")

    async def call(self, job: Any) -> Any:
        """`fn(job)`'s value; RenderTimeout or RenderFailed. Cancelling the caller leaves
        a started job to finish (or time out) in its thread, so a worker is never
        handed on with a reply still to come."""
        return await asyncio.wrap_future(self._threads.submit(self._call, job))

    def _call(self, job: Any) -> Any:
        worker = self._idle.get()  # NOTE: never waits: one thread per worker
        try:
            return worker.call(job, self.timeout_s)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
        self._threads.shutdown(wait=False, cancel_futures=True)


class _Worker:
    """One child process and its end of the socket pair; (re)started on demand."""

    def __init__(self, target: str, memory_bytes: int) -> None:
        self._target, self._memory_bytes = target, memory_bytes
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False  # the child said so
        self._lock = threading.Lock()  # guards _busy/_closed against close()
        self._busy = self._closed = False

    def call(self, job: Any, timeout_s: float) -> Any:
        with self._lock:
            if self._closed:
                raise RenderFailed("Closed", "the renderer is shut down")
            self._busy = True
        try:
            return self._exchange(job, timeout_s)
        finally:
            with self._lock:
                self._busy, closed = False, self._closed
            if closed:
                self._stop()

    def _exchange(self, job: Any, timeout_s: float) -> Any:
        try:
            if self._conn is None:
                self._spawn()
            conn = self._wait_ready()
            conn.send(job)
            if not conn.poll(timeout_s):
                self._stop()
                with contextlib.suppress(OSError):  # else the next call starts one
                    self._spawn()  # NOTE: it starts while nobody waits for it
                raise RenderTimeout(f"no answer within {timeout_s:g} s")
            reply = conn.recv()
        except (EOFError, OSError):
            self._stop()
            raise RenderFailed("WorkerDied", "the renderer process died") from None
        if reply[0] == "ok":
            return reply[1]
        raise RenderFailed(reply[1], reply[2])

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        code = (f"from chainspec.gateway.render_pool import serve; "
                f"serve({theirs.fileno()}, {self._target!r}, {self._memory_bytes})")
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                      env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn, self._ready = Connection(ours.detach()), False

    def _wait_ready(self) -> Connection:
        if not self._ready:
            if not self._conn.poll(START_TIMEOUT_S) or self._conn.recv() != "ready":
                raise EOFError  # NOTE: handled as a dead worker
            self._ready = True
        return self._conn

    def _stop(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is not None:
            proc.kill()
            proc.wait()
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed, busy = True, self._busy
        if not busy:
            self._stop()
        elif (proc := self._proc) is not None:
            proc.kill()  # the call in flight sees EOF, then stops the worker


def serve(fd: int, target: str, memory_bytes: int) -> None:
    """The child's loop: a job in, ("ok", value) or ("error", kind, message) out."""
    import importlib
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent()
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    _limit_memory(memory_bytes)
    os.nice(NICENESS)  # NOTE: after the imports; a runaway job yields the CPU to serving
    conn = Connection(fd)
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", fn(job))
        except MemoryError:
            reply = ("error", "MemoryError", "")
        except Exception as e:  # noqa: BLE001 -- every failure is the job's answer
            reply = ("error", type(e).__name__, str(e))
        conn.send(reply)


def _die_with_parent() -> None:
    """Exit when the parent is gone: its death signal where Linux offers one (it also
    stops a C-level loop), and a thread that notices a changed parent id."""
    parent = os.getppid()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _limit_memory(extra_bytes: int) -> None:
    """Cap the data segment at what the worker uses now plus `extra_bytes`."""
    try:
        import resource
        status = Path("/proc/self/status").read_text()
        used = next(int(line.split()[1]) * 1024 for line in status.splitlines()
                    if line.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (used + extra_bytes, used + extra_bytes))
    except (ImportError, OSError, StopIteration, ValueError):
        pass  # not Linux: time and size limits still hold

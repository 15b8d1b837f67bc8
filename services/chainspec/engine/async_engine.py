"""`AsyncVerifier`: a `VerifierEngine` driven by one background thread, for asyncio hosts.

Threading model: the engine is not thread-safe, so every engine call (add, abort, step,
and anything passed to `call`) runs on the engine thread, fed by a command queue. The
thread steps while the engine has work and sleeps on the queue when idle (no busy spin);
a new command wakes it. Outputs of a step go back to the event loop in one
`loop.call_soon_threadsafe` per loop and land in per-request asyncio queues; while that
wake-up waits to run, later steps' outputs join it (no second wake-up: each one is a
self-pipe write and a GIL hand-off on the engine's critical path); a reader that finds
several outputs waiting takes them as one (`_coalesce`).

Clients cannot kill the thread: a caller that gives up (cancelled while its command is
queued) leaves a cancelled future that the thread skips; a closed event loop is skipped
too. If the thread dies anyway (an engine bug), `failure` says why and the listeners
added with `on_failure` hear it at once; `stalled` tells a stuck thread from a busy one.

Slow readers: a request's committed tokens wait in its stream until its reader takes
them. A reader that falls `max_buffered_tokens` behind (a client that stopped reading:
gRPC flow control stops the servicer's writes) has its request aborted, so an unread
stream cannot keep its sequence running or its tokens piling up.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from chainspec.engine.admission import OWN_PARTY, Admission
from chainspec.engine.request import RequestOutput, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.verifier import VerifierEngine

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every slot is taken and the waiting queue is at its bound (RESOURCE_EXHAUSTED)."""


class EngineStopped(Exception):
    """The engine shut down (or failed) before the request finished (UNAVAILABLE)."""


class RequestIdInUse(ValueError):
    """A request with this id is still running (ALREADY_EXISTS)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | EngineStopped
    buffered: int = 0  # tokens in `queue`, not yet taken by the reader
    overflowed: bool = False  # the reader fell too far behind: abort asked for


class AsyncVerifier:
    def __init__(self, engine: VerifierEngine, max_waiting: int = 64,
                 max_buffered_tokens: int = 256, name: str = "verifier-engine") -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_buffered_tokens = max_buffered_tokens  # a reader this far behind: abort
        self.capacity = engine.config.max_seqs + max_waiting  # running + waiting
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # outputs posted to a loop whose wake-up has not run yet (guarded by the lock)
        self._pending: dict[asyncio.AbstractEventLoop, list[RequestOutput]] = {}
        self._pending_lock = threading.Lock()
        self._running = 0  # engine.num_running as of the last step (engine thread writes)
        self.steps = 0  # engine steps run, and their wall time (benchmarks, metrics)
        self.step_s_total = 0.0
        self._stopped: str | None = None  # why, once stopped
        self._failure: str | None = None  # why the thread died, if it did
        self._failure_listeners: list[Callable[[str], None]] = []
        self._busy_since: float | None = None  # when the current step/command began
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- event-loop side ------------------------------------------------------------
    @property
    def running(self) -> int:
        return min(self._running, len(self._streams))

    @property
    def waiting(self) -> int:
        return len(self._streams) - self.running

    @property
    def alive(self) -> bool:
        return self._stopped is None

    @property
    def failure(self) -> str | None:
        """Why the engine thread died (None while it lives, or after a clean shutdown)."""
        if self._failure is None and self._stopped is None and not self._thread.is_alive():
            return "verifier engine thread exited"
        return self._failure

    def stalled(self, limit_s: float) -> str | None:
        """Why the engine counts as stuck: one step or command has run for over `limit_s`
        (an idle engine, or one finishing steps, is live)."""
        busy_since = self._busy_since
        if busy_since is not None and time.monotonic() - busy_since > limit_s:
            return f"verifier engine made no progress for {time.monotonic() - busy_since:.1f} s"
        return None

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` (on the engine thread) if the thread dies."""
        self._failure_listeners.append(listener)
        if self._failure is not None:
            listener(self._failure)

    async def generate(self, request_id: str | None, prompt_ids: Sequence[int],
                       sampling: SamplingParams, stop: StopConditions,
                       admission: Admission = OWN_PARTY,
                       num_speculative_tokens: int | None = None,
                       generated: Sequence[int] = (),
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine commits them; the last one is finished.

        Raises ValueError (bad input), RequestIdInUse, QueueFull or EngineStopped. Leaving
        the iteration early (client gone, cancellation) aborts the request in the engine,
        and so does falling `max_buffered_tokens` behind (its last output is ABORT).
        """
        request_id = request_id or uuid.uuid4().hex
        arrival = time.perf_counter()  # TTFT and queue time count from here
        stream = self._open(request_id)
        try:
            await self.call(lambda: self.engine.add_request(request_id, prompt_ids,
                                                            sampling, stop, arrival,
                                                            admission,
                                                            num_speculative_tokens,
                                                            generated, cache_salt))
        except BaseException as e:
            self._streams.pop(request_id, None)
            if not isinstance(e, ValueError) and self.alive:  # cancelled while queued
                self._submit(lambda: self.engine.abort(request_id))
            raise
        finished, held = False, None
        try:
            while not finished:
                item = held if held is not None else await stream.queue.get()
                if isinstance(item, EngineStopped):
                    raise item
                item, held = _coalesce(item, stream.queue)
                stream.buffered -= len(item.new_tokens)
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.alive:
                self._submit(lambda: self.engine.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        """Stop a request; its stream ends with an ABORT output. False if unknown."""
        if request_id not in self._streams or not self.alive:
            return False
        return await self.call(lambda: self.engine.abort(request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps; returns its result."""
        done: Future = Future()

        def run() -> None:
            # NOTE: a caller cancelled while this waited in the queue (a client hanging up)
            # cancelled `done`; setting a result then would raise InvalidStateError here,
            # on the engine thread. Once RUNNING, `done` can no longer be cancelled.
            if not done.set_running_or_notify_cancel():
                return
            try:
                result = fn()
            except BaseException as e:  # handed to the caller
                done.set_exception(e)
            else:
                done.set_result(result)
        self._submit(run)
        return await asyncio.wrap_future(done)

    def shutdown(self, reason: str = "the verifier shut down") -> None:
        """Stop the engine thread; in-flight requests fail with EngineStopped(reason)."""
        if self._stopped is None:
            self._stopped = reason
            self._commands.put(None)
        self._thread.join(timeout=30)
        self._fail_all(reason)

    def _open(self, request_id: str) -> _Stream:
        if not self.alive:
            raise EngineStopped(self._stopped)
        if request_id in self._streams:
            raise RequestIdInUse(f"request id {request_id!r} is already in use")
        if len(self._streams) >= self.capacity:
            raise QueueFull(f"verifier is full: {self.engine.config.max_seqs} running and "
                            f"{self.max_waiting} waiting requests")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        return stream

    def _submit(self, command: Callable[[], None]) -> None:
        if not self.alive:
            raise EngineStopped(self._stopped)
        self._commands.put(command)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`: deliver every output posted to it since its wake-up was asked."""
        with self._pending_lock:
            outputs = self._pending.pop(loop, [])
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: hand each output to its request's stream."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(out)
            stream.buffered += len(out.new_tokens)
            if stream.buffered > self.max_buffered_tokens and not stream.overflowed \
                    and not out.finished and self.alive:
                stream.overflowed = True
                log.warning("request %s aborted: its reader is %d tokens behind (bound %d)",
                            out.request_id, stream.buffered, self.max_buffered_tokens)
                self._submit(lambda rid=out.request_id: self.engine.abort(rid))

    def _fail_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            _post(stream.loop, stream.queue.put_nowait, EngineStopped(reason))

    # -- engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._run_commands(block=not self.engine.has_work):
                if self.engine.has_work:
                    t0 = time.perf_counter()
                    self._busy_since = time.monotonic()
                    self._publish(self.engine.step())
                    self.steps += 1
                    self.step_s_total += time.perf_counter() - t0
                self._running = self.engine.num_running
                self._busy_since = None
        except BaseException as e:  # an engine bug: fail loudly, never hang the clients
            self._failure = self._stopped = f"verifier engine failed: {type(e).__name__}: {e}"
            self._fail_all(self._stopped)
            log.exception("verifier engine thread died")
            for listener in self._failure_listeners:
                listener(self._failure)

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one when `block`); False once told to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while command is not None:
            self._busy_since = time.monotonic()
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutput]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append(out)
        for loop, outs in by_loop.items():
            with self._pending_lock:
                if loop.is_closed():  # NOTE: its wake-up will never run: drop what waits
                    self._pending.pop(loop, None)
                    continue
                waiting = self._pending.get(loop)
                if waiting is not None:  # a wake-up is on its way: it takes these too
                    waiting.extend(outs)
                    continue
                self._pending[loop] = outs
            if not _post(loop, self._wake, loop):
                with self._pending_lock:  # NOTE: a closed loop: nobody will take them
                    self._pending.pop(loop, None)


def _coalesce(out: RequestOutput, waiting: asyncio.Queue
              ) -> tuple[RequestOutput, EngineStopped | None]:
    """`out` merged with the outputs already waiting behind it (a reader that fell behind
    sends one message for several steps, not one each), and an EngineStopped taken from
    the queue, to raise after. Lossless: tokens and logprobs keep their order; the
    finish, stop string, error and stats are the last output's (only a finished output
    carries them, and none follows it)."""
    while not out.finished and not waiting.empty():
        nxt = waiting.get_nowait()
        if isinstance(nxt, EngineStopped):
            return out, nxt
        logprobs = None if out.logprobs is None and nxt.logprobs is None else \
            (out.logprobs or ()) + (nxt.logprobs or ())
        out = replace(nxt, new_tokens=out.new_tokens + nxt.new_tokens, logprobs=logprobs)
    return out, None


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """`fn(*args)` on `loop`, unless that loop has closed (its clients are gone): False."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # closed between our look and the call: nobody is listening
        return False
    return True

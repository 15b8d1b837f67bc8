"""A tensor-parallel group's command channel (DESIGN 4.10): rank 0's messages to the
other ranks, and the heartbeat that checks an idle group (`engine/tp_group.py` runs the
ranks in lockstep over it)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from chainspec.engine.tp_packing import pack, unpack
from chainspec.models.tensor_parallel import TPGroup

IDLE_TIMEOUT_S = 600.0
HEARTBEAT_S = 2.0  # an idle group's rank 0 asks every rank for an answer this often
HEARTBEAT_TAG = 0x4842
SLAB = 16384  # bytes of a command broadcast: a verify step's inputs fit in one


class Channel:
    """Rank 0's commands to the other ranks: a message packed into bytes
    (`engine/tp_packing.py`), broadcast in a fixed slab of `SLAB` bytes (its length,
    then the bytes), so a step's message is one broadcast; a longer one sends the rest
    in a second. Rank 0's sends time out after the step timeout (a hung peer fails the
    step); the others' waits for the next command after the idle timeout.

    Heartbeat: while nothing was sent for `heartbeat_s`, a daemon thread on rank 0 sends
    a ping and waits up to the step timeout for every rank's answer (a point-to-point
    send: a broadcast's root finishes without its peers, so only an answer proves a rank
    runs). A rank that does not answer (hung, SIGSTOPped) fails the group: `failure`
    says why, `unresponsive` names the ranks, and every later send raises at once.
    Sends take a lock, so messages and heartbeats never interleave."""

    def __init__(self, tp: TPGroup, group, send_timeout_s: float,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S
                 ) -> None:
        self.tp, self.group = tp, group
        self.send_timeout = timedelta(seconds=send_timeout_s)
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = False
        self.failure: str | None = None
        self.unresponsive: frozenset[int] = frozenset()
        self.heartbeats = 0  # answered by every rank
        self._sent = False
        self._busy = 0  # calls of rank 0's in progress (`busy`)
        if tp.rank == 0 and tp.world > 1:
            every = min(heartbeat_s, idle_timeout_s / 3)
            threading.Thread(target=self._heartbeats, args=(every,), name="tp-heartbeat",
                             daemon=True).start()

    def _heartbeats(self, every_s: float) -> None:
        while not self._closed and self.failure is None:
            time.sleep(min(every_s / 4, 1.0))
            # NOTE: from rank 0's first message on: before it, the ranks may still load
            if self._sent and not self._busy and \
                    time.monotonic() - self._last_send > every_s:
                try:
                    self.heartbeat()
                except RuntimeError:  # a lost peer: recorded, the next step reports it
                    return

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Rank 0 runs a call the other ranks run too: no heartbeat meanwhile (their
        answer would wait for the whole call, which may outlast the step timeout while
        each collective inside it does not); idleness counts from its end."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self._last_send = time.monotonic()

    def heartbeat(self) -> None:
        """Rank 0: ping every rank and wait for their answers (RuntimeError, and the
        group failed, when one does not answer within the step timeout)."""
        with self._lock:
            if self._closed:
                return
            ranks = range(1, self.tp.world)
            try:
                self._send(pack(("ping",)))
            except RuntimeError:  # not even the ping went out: no rank is known alive
                silent = list(ranks)
            else:
                silent = self._silent(ranks)
            if silent:
                self.unresponsive = frozenset(silent)
                self.failure = (f"tensor-parallel rank(s) {silent} did not answer the "
                                f"heartbeat within {self.send_timeout.total_seconds():g}s")
                raise RuntimeError(self.failure)
            self.heartbeats += 1

    def _silent(self, ranks: range) -> list[int]:
        """The ranks whose answer does not come within the step timeout."""
        answers = {r: torch.zeros(1, dtype=torch.int64) for r in ranks}
        works = {r: self.group.recv([t], r, HEARTBEAT_TAG) for r, t in answers.items()}
        deadline = time.monotonic() + self.send_timeout.total_seconds()
        silent = []
        for r, work in works.items():
            try:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
            except RuntimeError:
                silent.append(r)
        return silent

    def answer(self) -> None:
        """A rank > 0, on a ping: tell rank 0 this rank runs."""
        self.group.send([torch.tensor([self.tp.rank])], 0, HEARTBEAT_TAG).wait()

    def _broadcast(self, t: torch.Tensor, timeout: timedelta | None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if timeout is not None:
            opts.timeout = timeout
        self.group.broadcast([t], opts).wait()

    def send(self, msg: tuple) -> None:
        t0 = time.perf_counter()
        data = pack(msg)  # [n] uint8
        with self._lock:
            if self._closed:
                return
            if self.failure is not None:
                raise RuntimeError(self.failure)
            self._closed = msg[0] == "stop"
            self._send(data)
        self.tp.stats.broadcasts += 1
        self.tp.stats.broadcast_seconds += time.perf_counter() - t0

    def _send(self, data: torch.Tensor) -> None:
        """Broadcast packed bytes (under the lock): the slab, then any rest."""
        slab = torch.zeros(SLAB, dtype=torch.uint8)
        slab[:8].view(torch.int64)[0] = data.numel()
        first = min(data.numel(), SLAB - 8)
        slab[8:8 + first] = data[:first]
        self._last_send, self._sent = time.monotonic(), True
        self._broadcast(slab, self.send_timeout)
        if data.numel() > first:
            self._broadcast(data[first:].clone(), self.send_timeout)

    def recv(self) -> tuple:
        slab = torch.empty(SLAB, dtype=torch.uint8)
        self._broadcast(slab, None)
        size = int(slab[:8].view(torch.int64))
        if size <= SLAB - 8:
            return unpack(slab[8:8 + size])
        rest = torch.empty(size - (SLAB - 8), dtype=torch.uint8)
        self._broadcast(rest, self.send_timeout)
        return unpack(torch.cat([slab[8:], rest]))

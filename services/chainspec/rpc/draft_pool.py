"""The verifier's gRPC draft client: one long-lived Draft stream per drafter (DESIGN 4.2).

`GrpcDraftClient` implements `engine.draft_client.DraftClient` with blocking methods,
called from the verifier engine's thread; one reader thread per stream deposits answers.

- Assignment is sticky and least-loaded: a sequence's first `start = 0` update picks the
  live drafter with the fewest sequences; later updates follow it.
- A sequence's first update past 0 that opens it from a prefix cache hit (its cache keys
  reach `start`, DESIGN 4.12) is assigned like a `start = 0` one, but to the drafter the
  hit's last block key was sent to, unless that one is far busier (`draft_affinity.py`):
  each drafter caches only the blocks it computed, and a hit sent elsewhere is a miss,
  a resync and a dense recompute there.
- An update with `start != 0` whose drafter is gone, draining or removed is not sent: the
  pool answers FAILED_PRECONDITION itself, the verifier resyncs with `start = 0`, and
  that update goes to a live drafter. A drafter's UNAVAILABLE (draining) is passed on
  the same way, so the sequence moves.
- `collect` waits until every batch that wants drafts has answered or its round deadline
  (`round_deadline_s` after it was sent) has passed; late answers are handed over at the
  next collect, where the verifier drops them as stale by `position`.
- A broken stream marks its drafter dead; its sequences lose their assignment and those
  waiting for drafts get FAILED_PRECONDITION, so the verifier decodes plainly and resyncs.
- Links heal: a drafter that is still wanted but whose stream ended for any reason (a
  GOAWAY, a restart, a network cut) or that could not be reached is reconnected in the
  background with jittered exponential backoff; its sequences come back by resync.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Collection, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chainspec.engine.draft_types import (
    DraftAhead,
    ErrorCode,
    SeqFailure,
    SeqOutcome,
    SeqUpdate,
    UpdateBatch,
    by_sequence,
)
from chainspec.rpc.channel import DEFAULT_CLIENT_OPTIONS, ClientOptions, make_channel
from chainspec.rpc.codec import WireDType
from chainspec.rpc.draft_affinity import PrefixAffinity
from chainspec.rpc.draft_codec import (
    DRAFTER_SERVICE,
    DraftLimits,
    decode_draft_response,
    encode_draft_request,
    stream_metadata,
)
from chainspec.rpc.draft_link import (
    CLOSE,
    DrafterMatch,
    DraftPoolStats,
    Link,
    LinkState,
    PoolObserver,
)
from chainspec.rpc.generated.v1 import drafter_pb2 as pb
from chainspec.rpc.generated.v1 import drafter_pb2_grpc as pb_grpc
from chainspec.rpc.round_trace import RoundTrace

log = logging.getLogger(__name__)
RECONNECT_BASE_S = 0.1  # first reconnect delay; doubles per failed try up to the max
RECONNECT_MAX_S = 5.0
STABLE_LINK_S = 5.0  # a stream that lived this long resets the backoff
BUSY_HORIZON_S = 30.0  # a batch unanswered longer is lost, not worked on (`busy`)


class GrpcDraftClient:
    """`DraftClient` over Draft streams to a changing set of drafters."""

    def __init__(self, endpoints: Sequence[str] = (), opts: ClientOptions = DEFAULT_CLIENT_OPTIONS,
                 round_deadline_s: float = 0.05,
                 hidden_dtype: WireDType | str = WireDType.F32,
                 match: DrafterMatch | None = None, connect_timeout_s: float = 10.0,
                 observer: PoolObserver | None = None, max_seqs: int | None = None) -> None:
        """`max_seqs`: the most sequences this verifier runs; each stream declares (and
        may then hold) no more than that, leaving the rest of a drafter to others."""
        if round_deadline_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("round_deadline_s and connect_timeout_s must be > 0")
        if max_seqs is not None and max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        self.max_seqs = max_seqs
        self.opts, self.round_deadline_s = opts, round_deadline_s
        self.hidden_dtype = WireDType.parse(hidden_dtype)
        self.match = match or DrafterMatch()
        self.connect_timeout_s = connect_timeout_s
        self.stats = DraftPoolStats()
        self.observer = observer
        self.trace: RoundTrace | None = None  # opt-in hop timestamps (benchmarks)
        self._cond = threading.Condition()  # guards everything below
        self._wanted: set[str] = set()
        self._connecting: set[str] = set()
        self._links: dict[str, Link] = {}  # current endpoints that were tried
        self._open: set[Link] = set()  # links whose stream may still answer
        self._owner: dict[int, Link] = {}
        self._homeless: set[int] = set()  # found no drafter at their last start = 0
        self._lost: set[int] = set()  # lost their drafter; the next one is a reassignment
        self._ready: dict[int, SeqOutcome] = {}
        self._ahead: dict[int, tuple[DraftAhead, ...]] = {}  # look-aheads (DESIGN 4.8)
        self._affinity = PrefixAffinity()  # where each drafter cache key went
        self._batch_ids = itertools.count(1)
        self._closed = False
        if endpoints:
            self.set_endpoints(endpoints)
            self.wait_connected(connect_timeout_s + 1.0)

    # -- membership -------------------------------------------------------------------
    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        """The drafters to use now: retire the others at once, connect new (or dead)
        ones in the background (see `wait_connected`). Never blocks on the network."""
        wanted = list(dict.fromkeys(endpoints))
        with self._cond:
            self._wanted = set(wanted)
            for ep in [ep for ep in self._links if ep not in self._wanted]:
                self._retire(self._links.pop(ep))
            todo = [ep for ep in wanted if ep not in self._connecting and
                    (ep not in self._links or self._links[ep].state is LinkState.DEAD)]
            self._connecting.update(todo)
        for ep in todo:
            self._start_connect(ep, failures=0)

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until no connection attempt is pending; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._connecting, timeout)

    def _start_connect(self, endpoint: str, failures: int) -> None:
        threading.Thread(target=self._connect_and_add, args=(endpoint, failures), daemon=True,
                         name=f"draft-pool-connect-{endpoint}").start()

    def _connect_and_add(self, endpoint: str, failures: int) -> None:
        link = self._connect(endpoint)
        with self._cond:
            self._connecting.discard(endpoint)
            if self._closed or endpoint not in self._wanted:
                self._shutdown_link(link)
            else:
                previous = self._links.get(endpoint)
                self._links[endpoint] = link
                if link.open:
                    self._open.add(link)
                    link.failures = failures
                    if previous is not None or failures:
                        self.stats.reconnects += 1
                        log.info("drafter %s reconnected", endpoint)
                else:
                    self._retry_later(endpoint, failures + 1)
            self._cond.notify_all()

    def _retry_later(self, endpoint: str, failures: int) -> None:
        """Reconnect a wanted endpoint after a jittered backoff (lock held)."""
        delay = min(RECONNECT_MAX_S, RECONNECT_BASE_S * 2 ** min(failures - 1, 16))
        timer = threading.Timer(delay * random.uniform(0.5, 1.0), self._retry,
                                args=(endpoint, failures))
        timer.daemon = True
        timer.start()

    def _retry(self, endpoint: str, failures: int) -> None:
        with self._cond:
            link = self._links.get(endpoint)
            if self._closed or endpoint not in self._wanted or endpoint in self._connecting \
                    or (link is not None and link.state is not LinkState.DEAD):
                return  # gone from the membership, or someone else reconnected it
            self._connecting.add(endpoint)
        self._connect_and_add(endpoint, failures)

    def accepting(self) -> bool:
        """Whether a live drafter has room for another sequence (a resync would land)."""
        with self._cond:
            return any(link.state is LinkState.LIVE and len(link.seqs) < link.capacity
                       for link in self._links.values())

    def busy(self) -> bool:
        """Whether a batch sent is still unanswered: a drafter works on it (a flush of
        held rows, a round past its deadline), taking a shared host's cores. NOTE: not
        for good: one unanswered past BUSY_HORIZON_S is lost (a hung drafter), and
        adaptive depth would never measure plain again."""
        horizon = time.perf_counter() - BUSY_HORIZON_S
        with self._cond:
            return any(sent > horizon for link in self._open
                       for sent, _ in link.outstanding.values())

    def loads(self) -> dict[str, int]:
        """Sequences assigned per usable drafter."""
        with self._cond:
            return {ep: len(link.seqs) for ep, link in self._links.items()
                    if link.state in (LinkState.LIVE, LinkState.DRAINING)}

    def states(self) -> dict[str, LinkState]:
        """Every wanted (or still answering) endpoint's link state."""
        with self._cond:
            out = {ep: link.state for ep, link in self._links.items()}
            for ep in self._wanted - out.keys():
                out[ep] = LinkState.CONNECTING
            return out

    def wanted(self) -> int:
        """How many drafters the membership lists for this verifier."""
        with self._cond:
            return len(self._wanted)

    def _connect(self, endpoint: str) -> Link:
        """Health SERVING, Info matching, then the stream and its reader thread."""
        link = Link(endpoint)
        link.channel = make_channel(endpoint, self.opts)
        try:
            health = health_pb2_grpc.HealthStub(link.channel).Check(
                health_pb2.HealthCheckRequest(service=DRAFTER_SERVICE),
                timeout=self.connect_timeout_s, wait_for_ready=True)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                raise ConnectionError("not SERVING")
            stub = pb_grpc.DrafterStub(link.channel)
            info = stub.Info(pb.DrafterInfoRequest(), timeout=self.connect_timeout_s)
            problem = self.match.mismatch(info)
            if problem:
                raise ConnectionError(f"incompatible drafter: {problem}")
        except (grpc.RpcError, ConnectionError) as e:
            log.warning("drafter %s not used: %s", endpoint, _describe(e))
            link.channel.close()
            return link
        link.limits = DraftLimits(info.hidden_size, info.vocab_size, info.num_draft_tokens,
                                  max_top_k=info.max_top_k or None)
        link.capacity = min(info.capacity, self.max_seqs or info.capacity)
        link.state, link.open = LinkState.LIVE, True
        link.opened_s = time.monotonic()
        # NOTE: declares what routing lets it hold (see _route); beyond that, refused
        requests = iter(link.requests.get, CLOSE)
        if self.trace is not None:
            requests = _traced(requests, self.trace)
        responses = stub.Draft(requests,
                               metadata=stream_metadata(max(1, link.capacity)))
        threading.Thread(target=self._read, args=(link, responses), daemon=True,
                         name=f"draft-pool-{endpoint}").start()
        return link

    def _retire(self, link: Link) -> None:
        """Stop using `link`; answers in flight still count, its sequences move later."""
        if link.state is not LinkState.DEAD:
            link.state = LinkState.RETIRED
        link.half_close()

    # -- DraftClient --------------------------------------------------------------------
    def submit(self, updates: Sequence[SeqUpdate]) -> None:
        with self._cond:
            batches: dict[Link, list[SeqUpdate]] = {}
            for u in updates:
                opens = u.opens_from_cache and u.seq_id not in self._owner
                link = self._route(u)
                if link is not None:
                    batches.setdefault(link, []).append(u)
                    self._affinity.sent(link.endpoint, u, opens)
            for link, batch in batches.items():
                self._send(link, batch)

    def collect(self, wait_for: Collection[int] | None = None) -> dict[int, SeqOutcome]:
        with self._cond:
            self._flush_releases()
            t0 = time.perf_counter()
            waited = False
            group = None if wait_for is None else frozenset(wait_for)
            while True:
                # NOTE: only batches holding drafts this round will verify are waited for
                # (pipelined groups: another group's drafts keep computing meanwhile)
                deadlines = [sent + self.round_deadline_s for link in self._open
                             for sent, wanted in link.outstanding.values()
                             if wanted and (group is None or not group.isdisjoint(wanted))]
                remaining = max(deadlines, default=t0) - time.perf_counter()
                if remaining <= 0:
                    break
                waited = True
                self._cond.wait(remaining)
            if waited:
                wait_s = time.perf_counter() - t0
                self.stats.rounds += 1
                self.stats.wait_s_total += wait_s
                self.stats.last_wait_s = wait_s
            ready, self._ready = self._ready, {}
            return ready

    def ahead(self) -> dict[int, tuple[DraftAhead, ...]]:
        with self._cond:
            entries, self._ahead = self._ahead, {}
            return entries

    def release(self, seq_ids: Sequence[int]) -> None:
        with self._cond:
            for seq_id in seq_ids:
                self._ready.pop(seq_id, None)
                self._ahead.pop(seq_id, None)
                self._homeless.discard(seq_id)
                self._lost.discard(seq_id)
                link = self._owner.pop(seq_id, None)
                if link is not None:
                    self._unassign(link, seq_id, tell_drafter=True)
            self._flush_releases()  # NOTE: now, not next step: an idle verifier sends none

    def close(self) -> None:
        with self._cond:
            self._closed = True
            links = [*self._links.values(), *self._open]
            self._links.clear()
        for link in set(links):
            self._shutdown_link(link)

    # -- routing and sending (lock held) ----------------------------------------------
    def _route(self, u: SeqUpdate) -> Link | None:
        owner = self._owner.get(u.seq_id)
        if owner is not None and owner.state is LinkState.LIVE:
            return owner
        if owner is not None:
            del self._owner[u.seq_id]
            self._lost.add(u.seq_id)
            self._unassign(owner, u.seq_id, tell_drafter=True)
        if u.start != 0 and u.seq_id in self._homeless:
            # NOTE: not FAILED_PRECONDITION: a resync would find no drafter either, and a
            # verifier that retried resyncs would recompute the prefix every round
            return self._local(u, ErrorCode.UNAVAILABLE, "no drafter available")
        if u.start != 0 and not (owner is None and u.opens_from_cache):
            where = "none" if owner is None else f"{owner.endpoint} is {owner.state}"
            return self._local(u, ErrorCode.FAILED_PRECONDITION,
                               f"sequence {u.seq_id} has no drafter ({where}); resync")
        live = [link for link in self._links.values()
                if link.state is LinkState.LIVE and len(link.seqs) < link.capacity]
        if not live:
            self._homeless.add(u.seq_id)
            return self._local(u, ErrorCode.UNAVAILABLE, "no drafter available")
        self._homeless.discard(u.seq_id)
        if u.seq_id in self._lost:
            self._lost.discard(u.seq_id)
            self.stats.reassignments += 1
        link = self._affinity.choose(u, live)
        self.stats.affine_hits += link is not None
        link = link or min(live, key=lambda link: len(link.seqs))
        self._owner[u.seq_id] = link
        link.seqs.add(u.seq_id)
        return link

    def _local(self, u: SeqUpdate, code: ErrorCode, message: str) -> None:
        expected = 0 if code is ErrorCode.FAILED_PRECONDITION else None
        self._ready[u.seq_id] = SeqFailure(u.seq_id, code, message, expected)
        self.stats.local_failures += 1
        return None

    def _unassign(self, link: Link, seq_id: int, tell_drafter: bool) -> None:
        link.seqs.discard(seq_id)
        if tell_drafter and link.open and not link.half_closed:
            link.pending_releases.append(seq_id)
        if link.state is LinkState.DRAINING and not link.seqs and not link.outstanding:
            link.half_close()  # lets the drafter finish its drain early

    def _send(self, link: Link, updates: Sequence[SeqUpdate]) -> None:
        batch_id = next(self._batch_ids)
        if self.trace is not None:
            self.trace.mark(batch_id, "v_send")
        releases, link.pending_releases = tuple(link.pending_releases), []
        msg = encode_draft_request(UpdateBatch(batch_id, tuple(updates), releases),
                                   self.hidden_dtype)
        if self.trace is not None:
            self.trace.mark(batch_id, "v_encoded")
        wanted = frozenset(u.seq_id for u in updates if u.want_drafts)
        link.outstanding[batch_id] = (time.perf_counter(), wanted)
        self.stats.batches_sent += 1
        self.stats.bytes_sent += msg.ByteSize()
        link.requests.put(msg)

    def _flush_releases(self) -> None:
        for link in self._open:
            if link.pending_releases and not link.half_closed:
                self._send(link, ())

    # -- answers (reader threads) -----------------------------------------------------
    def _read(self, link: Link, responses) -> None:
        error: grpc.RpcError | None = None
        try:
            for msg in responses:
                if self.trace is not None:
                    self.trace.mark(msg.batch_id, "v_recv")
                size = msg.ByteSize()
                reply = decode_draft_response(msg, link.limits)
                if self.trace is not None:
                    self.trace.mark(msg.batch_id, "v_decoded")
                with self._cond:
                    self.stats.bytes_received += size
                    if msg.look_ahead:
                        self._on_ahead(link, reply.ahead)
                    else:
                        self._on_reply(link, reply.batch_id, reply.results)
                    self._cond.notify_all()
        except grpc.RpcError as e:
            error = e
        with self._cond:
            self._on_stream_end(link, error)
            self._cond.notify_all()
        link.channel.close()

    def _on_reply(self, link: Link, batch_id: int, results: Sequence[SeqOutcome]) -> None:
        sent = link.outstanding.pop(batch_id, None)
        now = time.perf_counter()
        if sent is not None and now > sent[0] + self.round_deadline_s:
            self.stats.late_batches += 1
        if sent is not None and self.observer is not None:
            self.observer.round_trip(now - sent[0])
        for out in results:
            if self._owner.get(out.seq_id) is not link:
                continue  # released or moved since
            if isinstance(out, SeqFailure) and out.code is ErrorCode.UNAVAILABLE:
                if link.state is LinkState.LIVE:
                    link.state = LinkState.DRAINING
                del self._owner[out.seq_id]
                self._lost.add(out.seq_id)
                self._unassign(link, out.seq_id, tell_drafter=False)  # it dropped the seq
                out = SeqFailure(out.seq_id, ErrorCode.FAILED_PRECONDITION,
                                 f"drafter {link.endpoint} is draining ({out.message}); "
                                 f"resync elsewhere", 0)
            elif isinstance(out, SeqFailure) and out.code is ErrorCode.RESOURCE_EXHAUSTED:
                del self._owner[out.seq_id]
                self._lost.add(out.seq_id)
                self._unassign(link, out.seq_id, tell_drafter=True)
            self._ready[out.seq_id] = out
        if link.state is LinkState.DRAINING and not link.seqs and not link.outstanding:
            link.half_close()

    def _on_ahead(self, link: Link, entries: Sequence[DraftAhead]) -> None:
        self.stats.ahead_entries += len(entries)
        for seq_id, es in by_sequence(entries).items():
            if self._owner.get(seq_id) is link:  # not released or moved since
                self._ahead[seq_id] = es

    def _on_stream_end(self, link: Link, error: grpc.RpcError | None) -> None:
        link.open = False
        self._open.discard(link)
        broken = not link.half_closed or error is not None
        if broken and not self._closed:
            self.stats.stream_failures += 1
            log.warning("drafter %s stream ended: %s", link.endpoint, _describe(error))
        if link.state is not LinkState.RETIRED:
            link.state = LinkState.DEAD  # drained or broken: reconnected if listed again
        link.half_close()  # unblocks grpc's request-consumer thread
        waiting = set().union(*(wanted for _, wanted in link.outstanding.values()))
        for seq_id in link.seqs:
            del self._owner[seq_id]
            self._lost.add(seq_id)
            if seq_id in waiting:
                self._ready[seq_id] = SeqFailure(
                    seq_id, ErrorCode.FAILED_PRECONDITION,
                    f"drafter {link.endpoint} lost: {_describe(error)}; resync elsewhere", 0)
        link.seqs.clear()
        link.outstanding.clear()
        link.pending_releases.clear()
        if link.state is LinkState.DEAD and not self._closed \
                and self._links.get(link.endpoint) is link and link.endpoint in self._wanted:
            lived = time.monotonic() - link.opened_s
            self._retry_later(link.endpoint, 1 if lived >= STABLE_LINK_S else link.failures + 1)

    def _shutdown_link(self, link: Link) -> None:
        link.half_close()
        if link.channel is not None:
            link.channel.close()


def _traced(requests, trace: RoundTrace):
    """`requests`, marking when grpc's consumer thread takes each one."""
    for msg in requests:
        trace.mark(msg.batch_id, "v_pulled")
        yield msg


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "stream ended"
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return str(error)

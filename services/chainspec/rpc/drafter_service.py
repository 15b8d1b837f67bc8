"""The Drafter gRPC service over a `DrafterEngine` (DESIGN 4.1, 4.3).

Threading: the engine is not thread-safe and runs one round at a time, so every touch
of it (decode, releases, `update`, encode, a stream's cleanup, warm-up) runs on the
event loop's thread, the engine's only thread. A request is answered where it arrives:
no hop to a worker thread and back (two thread wake-ups a round); a round blocks the
loop, which could not start another round meanwhile anyway. A stream's requests are
answered one at a time, in order: each once, or under draft-ahead in two parts when it
mixes look-ahead hits with updates whose drafts the verifier waits for (those first).

Sequence ids are scoped per stream: each stream maps the verifier's `seq_id`s to
engine-unique ids (errors name the verifier's), and everything the stream holds is
released when it ends. A stream holds at most the sequences its verifier declared in the
`x-chainspec-max-seqs` metadata, or a fair share of the drafter when undeclared; a new
sequence beyond that is refused RESOURCE_EXHAUSTED for that sequence alone.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import grpc
import torch

from chainspec.engine.draft_types import (
    DraftReply,
    DraftResult,
    ErrorCode,
    SeqFailure,
    SeqOutcome,
    SeqUpdate,
    UpdateBatch,
)
from chainspec.engine.drafter import DrafterEngine
from chainspec.engine.fingerprint import model_fingerprint
from chainspec.engine.lookahead import AheadSource
from chainspec.metrics.drafter import DrafterMetrics
from chainspec.rpc.codec import WireError, invalid
from chainspec.rpc.draft_codec import (
    DRAFTER_SERVICE,
    MAX_SEQS_KEY,
    DraftLimits,
    decode_draft_request,
    encode_ahead_response,
    encode_draft_response,
)
from chainspec.rpc.generated.v1 import drafter_pb2 as pb
from chainspec.rpc.generated.v1 import drafter_pb2_grpc as pb_grpc
from chainspec.rpc.round_trace import RoundTrace
from chainspec.rpc.server import RunningServer, ServerOptions, start_server
from chainspec.version import chainspec_version

WARMUP_SEQ = -1  # engine ids from streams are >= 0
UNKNOWN_SEQ = -2  # stands for a verifier id the stream does not hold
UNDECLARED_SHARE = 4  # an undeclared stream may hold 1/4 of the drafter (at least 1)


@dataclass(eq=False)
class _Stream:
    """What one Draft stream holds: the verifier's seq_id -> engine id, and its bound."""

    limit: int
    ids: dict[int, int] = field(default_factory=dict)


def stream_limit(metadata, capacity: int) -> int:
    """Sequences a stream may hold: what its verifier declared in `x-chainspec-max-seqs`,
    else a fair share of `capacity`. Raises WireError for a value that is no count."""
    for key, value in metadata or ():
        if key == MAX_SEQS_KEY:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if not (text.isascii() and text.isdigit() and 1 <= int(text) < 2 ** 31):
                raise invalid(f"{MAX_SEQS_KEY}: expected a positive integer, got {text!r}")
            return int(text)
    return max(1, capacity // UNDECLARED_SHARE)


class DrafterServicer(pb_grpc.DrafterServicer):
    """Draft (bidi stream) and Info over one engine; see the module docstring."""

    def __init__(self, engine: DrafterEngine, model_name: str,
                 max_message_bytes: int = 64 * 2 ** 20, fingerprint: str | None = None) -> None:
        self.engine, self.model_name = engine, model_name
        self.max_message_bytes = max_message_bytes
        self.fingerprint = fingerprint
        c = engine.config
        self.limits = DraftLimits(engine.hidden_size, engine.vocab_size, c.num_steps,
                                  max_rows=c.max_len, max_top_k=c.top_k)
        self.draining = False
        self._warm = asyncio.Event()  # set once warm-up no longer touches the engine
        self._ids = itertools.count()  # engine ids; touched on the loop's thread only
        self.trace: RoundTrace | None = None  # opt-in hop timestamps (benchmarks)

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_DrafterServicer_to_server(self, server)

    # -- rpc methods ------------------------------------------------------------------
    async def Draft(self, request_iterator, context):
        try:
            limit = stream_limit(context.invocation_metadata(), self.engine.config.max_seqs)
        except WireError as e:
            await context.abort(e.code, e.message)
        stream = _Stream(limit)
        await self._warm.wait()  # NOTE: warm-up runs off the loop; never beside a round
        try:
            async for request in request_iterator:
                if self.trace is not None:
                    self.trace.mark(request.batch_id, "d_recv")
                # NOTE: on the loop's thread (the engine's); see the module docstring
                batch, failures = self.decode(request)
                batch, rest = self._split(stream, batch)
                response = self.answer(stream, request, (batch, failures))
                # NOTE: taken before another stream's round can replace them
                early, pending = self.engine.pending_early(), self.engine.pending_ahead()
                if self.trace is not None:
                    self.trace.mark(request.batch_id, "d_send")
                yield response
                if rest is not None:  # the hits, after the answer the verifier waits for
                    response = self._answer_rest(stream, rest, pending)
                    early, pending = self.engine.pending_early(), self.engine.pending_ahead()
                    yield response
                if early is not None:  # the hits' look-ahead, its first round done
                    ahead = self.look_ahead_early(stream, request.batch_id, early)
                    if ahead is not None:
                        yield ahead
                if pending:  # draft-ahead: after the answer is on its way (DESIGN 4.8)
                    ahead = self.look_ahead(stream, request.batch_id, pending)
                    if ahead is not None:
                        yield ahead
        finally:
            self._release_stream(stream)

    async def Info(self, request, context) -> pb.DrafterInfo:
        e, c = self.engine, self.engine.config
        return pb.DrafterInfo(
            model_name=self.model_name, weights_fingerprint=self.fingerprint or "",
            num_draft_tokens=c.num_steps, num_mtp_modules=e.model.num_modules,
            hidden_size=e.hidden_size, vocab_size=e.vocab_size,
            dtype=str(e.dtype).removeprefix("torch."), chain=c.chain, capacity=c.max_seqs,
            load=e.load, version=chainspec_version(), max_top_k=c.top_k,
            max_message_bytes=self.max_message_bytes)

    # -- lifecycle ----------------------------------------------------------------------
    async def warm_up(self) -> None:
        """One throwaway round on a scratch sequence (and the fingerprint), off the loop
        so that health answers NOT_SERVING meanwhile; streams wait for it."""
        try:
            await asyncio.to_thread(self._warm_up)
        finally:
            self._warm.set()

    def _warm_up(self) -> None:
        if self.fingerprint is None:
            self.fingerprint = model_fingerprint(self.engine.model)
        k = self.engine.config.num_steps
        hidden = torch.zeros(k, self.engine.hidden_size)  # [K, H]
        try:
            out = self.engine.update([SeqUpdate(WARMUP_SEQ, 0, (0,) * k, hidden)])
            if isinstance(out[0], SeqFailure):
                raise RuntimeError(f"drafter warm-up failed: {out[0].message}")
        finally:
            self.engine.release([WARMUP_SEQ])

    def begin_drain(self) -> None:
        """From now on every update is answered UNAVAILABLE (the verifier moves it)."""
        self.draining = True

    def close(self) -> None:
        """After the server stopped. Nothing is left to finish: streams released what they
        held when they ended, on the loop."""

    # -- one request, on the loop's thread -------------------------------------------
    def decode(self, request: pb.DraftRequest):
        """The request's (UpdateBatch, per-update failures)."""
        if self.trace is not None:
            self.trace.mark(request.batch_id, "d_start")
        decoded = decode_draft_request(request, self.limits)
        if self.trace is not None:
            self.trace.mark(request.batch_id, "d_decoded")
        return decoded

    def answer(self, stream: _Stream, request: pb.DraftRequest,
               decoded=None) -> pb.DraftResponse:
        trace = self.trace
        batch, failures = decoded if decoded is not None else self.decode(request)
        self._release(stream, batch.releases)
        if self.draining:
            results = self._refuse(stream, batch.updates)
        else:
            results = self._draft(stream, batch.updates)
        if trace is not None:
            trace.mark(request.batch_id, "d_drafted")
        response = encode_draft_response(DraftReply(batch.batch_id, (*failures, *results)))
        if trace is not None:
            trace.mark(request.batch_id, "d_encoded")
        return response

    def _split(self, stream: _Stream, batch: UpdateBatch
               ) -> tuple[UpdateBatch, UpdateBatch | None]:
        """The batch's part to answer first, and its hits to answer after it, if the
        engine splits them (DrafterEngine.split_hits); else (batch, None)."""
        if self.draining or not any(u.verifying for u in batch.updates):
            return batch, None
        scoped = [replace(u, seq_id=stream.ids.get(u.seq_id, UNKNOWN_SEQ))
                  for u in batch.updates]
        first, after = self.engine.split_hits(scoped)
        if not after:
            return batch, None
        ups = batch.updates
        return (replace(batch, updates=tuple(ups[i] for i in first)),
                UpdateBatch(batch.batch_id, tuple(ups[i] for i in after)))

    def _answer_rest(self, stream: _Stream, rest: UpdateBatch,
                     pending: list[AheadSource]) -> pb.DraftResponse:
        """A second answer to the batch: its hits, their exact round also drafting the
        first look-ahead round of `pending` (the first part's) and their own. NOTE: the
        verifier's client takes a second reply to a batch like the first."""
        if self.trace is not None:  # NOTE: its round is the look-ahead's first
            self.trace.mark(rest.batch_id, "d_ahead_start")
        if self.draining:  # NOTE: it may begin while the first part is on its way
            results = self._refuse(stream, rest.updates)
        else:
            results = self._draft(stream, rest.updates, rest_of=pending)
        return encode_draft_response(DraftReply(rest.batch_id, tuple(results)))

    def _draft(self, stream: _Stream, updates: Sequence[SeqUpdate],
               rest_of: list[AheadSource] | None = None) -> list[SeqOutcome]:
        fresh: set[int] = set()  # verifier ids given an engine id by this request
        scoped, admitted, refused = [], [], []
        for u in updates:
            eid = stream.ids.get(u.seq_id)
            opens = u.start == 0 or u.opens_from_cache  # a prefix cache hit opens past 0
            if eid is None and opens and len(stream.ids) >= stream.limit:
                refused.append(SeqFailure(
                    u.seq_id, ErrorCode.RESOURCE_EXHAUSTED,
                    f"sequence {u.seq_id}: this stream already holds {len(stream.ids)} "
                    f"sequences, its limit ({MAX_SEQS_KEY})"))
                continue
            if eid is None:
                eid = next(self._ids)
                if opens:
                    stream.ids[u.seq_id] = eid
                    fresh.add(u.seq_id)
            scoped.append(replace(u, seq_id=eid))
            admitted.append(u)
        t0 = time.perf_counter()
        if not scoped:
            outcomes = []
        else:  # NOTE: `rest_of` only where it is one (engines that tests stand in for)
            outcomes = self.engine.update(scoped) if rest_of is None else \
                self.engine.update(scoped, rest_of)
        elapsed = time.perf_counter() - t0
        results: list[SeqOutcome] = refused
        for u, eu, out in zip(admitted, scoped, outcomes, strict=True):
            if isinstance(out, SeqFailure) and u.seq_id in fresh:
                del stream.ids[u.seq_id]  # the engine holds nothing for it
            if isinstance(out, SeqFailure) or u.want_drafts:
                results.append(_unscoped(out, u.seq_id, eu.seq_id, elapsed))
        return results

    def look_ahead(self, stream: _Stream, batch_id: int,
                   pending: list[AheadSource]) -> pb.DraftResponse | None:
        """The look-ahead response to `batch_id`, under the verifier's ids."""
        return self._ahead_response(stream, batch_id, lambda: self.engine.look_ahead(pending))

    def look_ahead_early(self, stream: _Stream, batch_id: int,
                         first) -> pb.DraftResponse | None:
        """The look-ahead for `batch_id`'s updates that verified one of our entries,
        whose first round ran in their exact round (DrafterEngine.look_ahead_early)."""
        return self._ahead_response(stream, batch_id,
                                    lambda: self.engine.look_ahead_early(first))

    def _ahead_response(self, stream: _Stream, batch_id: int, run) -> pb.DraftResponse | None:
        back = {eid: sid for sid, eid in stream.ids.items()}
        if self.trace is not None:
            self.trace.mark(batch_id, "d_ahead_start")
        entries = [replace(e, seq_id=back[e.seq_id],
                           drafts=replace(e.drafts, seq_id=back[e.seq_id]))
                   for e in run() if e.seq_id in back]
        if self.trace is not None:
            self.trace.mark(batch_id, "d_ahead_end")
        return encode_ahead_response(batch_id, entries) if entries else None

    def _refuse(self, stream: _Stream, updates: Sequence[SeqUpdate]) -> list[SeqFailure]:
        self._release(stream, [u.seq_id for u in updates])
        return [SeqFailure(u.seq_id, ErrorCode.UNAVAILABLE,
                           "drafter is draining; resync on another drafter") for u in updates]

    def _release(self, stream: _Stream, seq_ids: Iterable[int]) -> None:
        eids = [stream.ids.pop(s) for s in seq_ids if s in stream.ids]
        self.engine.release(eids)

    def _release_stream(self, stream: _Stream) -> None:
        self.engine.release(list(stream.ids.values()))
        stream.ids.clear()


def _unscoped(out: SeqOutcome, seq_id: int, engine_id: int, elapsed: float) -> SeqOutcome:
    """The engine's outcome under the verifier's id (and the wire's conventions)."""
    if isinstance(out, SeqFailure):
        expected = out.expected_start
        if out.code == ErrorCode.FAILED_PRECONDITION and expected is None:
            expected = 0  # holds nothing for it: restart from 0
        # NOTE: engine messages name the engine's id; the verifier knows only its own
        message = re.sub(rf"\bsequence {engine_id}\b", f"sequence {seq_id}", out.message)
        return replace(out, seq_id=seq_id, expected_start=expected, message=message)
    return DraftResult(seq_id, out.position, out.tokens, out.support, out.probs, elapsed)


async def serve_drafter(engine: DrafterEngine, opts: ServerOptions, model_name: str,
                        fingerprint: str | None = None,
                        metrics: DrafterMetrics | None = None) -> RunningServer:
    """Start the Drafter service, warm the engine up, then report SERVING. `metrics` (the
    engine's observer, if any) also counts the gRPC calls and is served on
    `opts.metrics_port` when set."""
    servicer = DrafterServicer(engine, model_name, opts.max_message_bytes, fingerprint)
    if metrics is not None:
        c = engine.config
        metrics.set_info(c.num_steps, str(engine.dtype).removeprefix("torch."), c.chain)
    running = await start_server(opts, servicer.register, [DRAFTER_SERVICE], metrics)
    running.add_drain_hook(servicer.begin_drain)
    running.add_stop_hook(servicer.close)
    try:
        await servicer.warm_up()
    except BaseException:
        await running.stop(0)
        raise
    await running.set_serving(True)
    return running

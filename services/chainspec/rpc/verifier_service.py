"""The Verifier gRPC service over an `AsyncVerifier` (DESIGN 4.2, 4.3).

`Generate` parses and validates the request (generate_codec), streams the engine's
outputs as token chunks with incremental text, and ends with one finished message.
Status contract: bad input INVALID_ARGUMENT (the message names the field), a duplicate
request id ALREADY_EXISTS, a full server RESOURCE_EXHAUSTED, a draining or stopped one
UNAVAILABLE. A client that goes away aborts its request (slot freed, drafter released).

Parsing a large request (tokenizing a long prompt) runs on a worker thread, never on the
event loop, and a prompt text too long to fit the context is refused untokenized.
`Abort` stops a request only for its owner: a call on the connection that started it,
or one carrying the abort key that Generate sent in its initial metadata.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from chainspec.engine.admission import SchedulingPolicy
from chainspec.engine.async_engine import AsyncVerifier, EngineStopped, QueueFull, RequestIdInUse
from chainspec.engine.detokenizer import IncrementalDetokenizer
from chainspec.engine.factory import build_verifier_engine, load_draft, load_target_model
from chainspec.engine.fingerprint import model_fingerprint
from chainspec.engine.grammar import Grammar, GrammarCompiler, GrammarSpec
from chainspec.engine.local import LocalDrafts, local_drafter
from chainspec.engine.options import DrafterMode, LocalOptions
from chainspec.engine.request import FinishReason, RequestOutput, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.metrics.verifier import VerifierMetrics
from chainspec.models.hub import served_name
from chainspec.models.target import TargetModel
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.channel import ClientOptions
from chainspec.rpc.codec import WireError
from chainspec.rpc.draft_pool import DrafterMatch, GrpcDraftClient
from chainspec.rpc.engine_watchdog import EngineWatchdog
from chainspec.rpc.generate_codec import (
    GenerateArgs,
    GenerateLimits,
    chunk_message,
    finished_message,
    parse_generate,
)
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.generated.v1 import verifier_pb2_grpc as pb_grpc
from chainspec.rpc.server import RunningServer, ServerOptions, start_server
from chainspec.version import chainspec_version

if TYPE_CHECKING:  # NOTE: only a type here; rpc/ does not import cluster/
    from chainspec.cluster.config import StackConfig

VERIFIER_SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
ABORT_KEY = "x-chainspec-abort-key"  # Generate's initial metadata: the request's secret
INLINE_PARSE_BYTES = 4 * 1024  # larger requests are parsed on a worker thread (~1 µs a char)
PARSE_THREADS = 2
# A text prompt longer than context * (longest token's characters) * slack cannot fit.
# NOTE: slack for normalizers that shrink text (NFKC composition, stripping).
TEXT_SLACK = 4


@dataclass(frozen=True)
class _Owner:
    """Who started a request: the connection (gRPC peer) and the abort key it got."""

    peer: str
    key: str

    def allows(self, peer: str, key: str) -> bool:
        return peer == self.peer or (bool(key) and hmac.compare_digest(
            key.encode(), self.key.encode()))


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, engine: AsyncVerifier, limits: GenerateLimits,
                 tokenizer: Tokenizer | None, model_name: str, fingerprint: str = "",
                 drafters: Callable[[], int] = lambda: 0) -> None:
        if tokenizer is not None and limits.max_text_chars is None:
            limits = replace(limits, max_text_chars=limits.context * TEXT_SLACK *
                             tokenizer.max_token_chars)
        self.engine, self.limits, self.tokenizer = engine, limits, tokenizer
        self.model_name, self.fingerprint, self.drafters = model_name, fingerprint, drafters
        self._encode = tokenizer.encode if tokenizer is not None else None
        self._parser = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="verifier-parse")
        self._grammars: GrammarCompiler | None = None  # built by the first grammar request
        self._owners: dict[str, _Owner] = {}  # request id -> who may abort it

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_VerifierServicer_to_server(self, server)

    def close(self) -> None:
        self._parser.shutdown(wait=False, cancel_futures=True)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            args = await self._parse(request)
        except WireError as e:
            await context.abort(e.code, e.message)
        rid = args.request_id or uuid.uuid4().hex
        if rid in self._owners:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {rid!r} is already in use")
        owner = self._owners[rid] = _Owner(context.peer(), secrets.token_urlsafe(16))
        try:
            await context.send_initial_metadata(((ABORT_KEY, owner.key),))
            async for message in self._run(rid, args, context):
                yield message
        finally:
            if self._owners.get(rid) is owner:
                del self._owners[rid]

    async def _parse(self, request: pb.GenerateRequest) -> GenerateArgs:
        compile_grammar = self._compile_grammar if self.tokenizer is not None else None
        if request.ByteSize() <= INLINE_PARSE_BYTES and \
                not request.sampling.HasField("grammar"):  # NOTE: compiling takes a while
            return parse_generate(request, self.limits, self._encode, compile_grammar)
        return await asyncio.get_running_loop().run_in_executor(
            self._parser, parse_generate, request, self.limits, self._encode, compile_grammar)

    def _compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """On a parse thread; the first call builds the compiler (and imports xgrammar).
        Its stop tokens are the engine's EOS ids (serve_verifier's)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler.for_tokenizer(
                self.tokenizer, self.limits.vocab_size, self.tokenizer.eos_token_ids)
        return self._grammars.compile(spec)

    async def _run(self, rid: str, args: GenerateArgs, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[pb.GenerateResponse]:
        writer = _ResponseWriter(rid, args.prompt, self.tokenizer, args.stop.stop_strings,
                                 args.include_stop_str)
        writer.resume(args.generated, args.text_sent)
        try:
            async for out in self.engine.generate(rid, args.prompt, args.sampling, args.stop,
                                                  args.admission, args.num_speculative_tokens,
                                                  generated=args.generated,
                                                  cache_salt=args.cache_salt):
                for message in writer.messages(out):
                    yield message
        except RequestIdInUse:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {rid!r} is already in use")
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineStopped as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; retry on another verifier")
        except ValueError as e:  # what the engine refused at admission
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {e}")

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        """Found only for the request's owner; anyone else learns nothing."""
        owner = self._owners.get(request.request_id)
        if owner is None or not owner.allows(context.peer(), request.abort_key):
            return pb.AbortResponse(found=False)
        return pb.AbortResponse(found=await self.engine.abort(request.request_id))

    async def Info(self, request: pb.VerifierInfoRequest, context) -> pb.VerifierInfo:
        e = self.engine
        return pb.VerifierInfo(
            model_name=self.model_name, weights_fingerprint=self.fingerprint,
            num_draft_tokens=self.limits.num_steps, capacity=e.engine.config.max_seqs,
            running=e.running, waiting=e.waiting, drafters=self.drafters(),
            max_model_len=self.limits.context, version=chainspec_version(), continues=True)


class _ResponseWriter:
    """Engine outputs of one request -> Generate stream messages."""

    def __init__(self, request_id: str, prompt: Sequence[int], tokenizer: Tokenizer | None,
                 stop_strings: tuple[str, ...], include_stop_str: bool = False) -> None:
        self.request_id, self.prompt_len = request_id, len(prompt)
        self.include_stop_str = include_stop_str
        # NOTE: seeded with the prompt: the first token's text reads as its continuation
        self.detok = IncrementalDetokenizer(tokenizer.backend, prompt, stop_strings) \
            if tokenizer is not None else None
        self.completion_tokens = 0
        self._skip, self._backlog = 0, ""  # a continuation's text sent before / not yet

    def resume(self, generated: Sequence[int], text_sent: int) -> None:
        """Continue after `generated` (a continuation): its tokens are decoded first, and
        of the text the first `text_sent` characters, which the client has, are not sent
        again; what the previous verifier held back goes out with the next chunk."""
        self.completion_tokens = len(generated)
        self._skip = text_sent
        if self.detok is not None and generated:
            self._backlog = self._unsent(self.detok.add(generated))

    def _unsent(self, text: str) -> str:
        """`text` less what the client already has (a continuation's first characters)."""
        drop = min(self._skip, len(text))
        self._skip -= drop
        return text[drop:]

    def messages(self, out: RequestOutput) -> list[pb.GenerateResponse]:
        self.completion_tokens += len(out.new_tokens)
        if self.detok is None:
            text = ""
        elif out.finished:
            shown = out.new_tokens
            if out.finish_reason is FinishReason.STOP and out.stop_string is None and \
                    not self.include_stop_str and shown:
                shown = shown[:-1]  # NOTE: a stop token id: its text is not output (vLLM)
            text = self.detok.finish(shown, out.stop_string, self.include_stop_str)
        else:
            text = self.detok.add(out.new_tokens)
        text, self._backlog = self._backlog + self._unsent(text), ""
        msgs = [chunk_message(self.request_id, out.new_tokens, text, out.logprobs)] \
            if out.new_tokens or text else []
        if out.finished:
            msgs.append(finished_message(self.request_id, out, self.prompt_len,
                                         self.completion_tokens))
        return msgs


# ----------------------------------------------------------------------------- hosting


@dataclass(frozen=True)
class VerifierOptions:
    """What a verifier loads and how it admits requests."""

    model: LocalOptions = LocalOptions()
    model_name: str = ""  # default: the model directory's name
    max_waiting: int = 64  # queued requests beyond the running slots
    default_max_tokens: int = 256
    draft_deadline_s: float = 0.05  # how long a round waits for drafts
    stall_limit_s: float = 60.0  # one engine step or command longer than this: not serving
    drafter: DrafterMode = DrafterMode.REMOTE  # local: the MTP modules run in this process
    groups: int = 1  # pipelined groups taking turns (VerifierConfig.groups, DESIGN 4.8)
    draft_ahead: bool = False  # use look-ahead drafts on a hit (VerifierConfig.draft_ahead)
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS  # engine/admission.py
    max_buffered_tokens: int = 256  # tokens a stream's reader may fall behind, then abort

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafter", DrafterMode(self.drafter))  # ValueError: unknown
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        if self.max_buffered_tokens < 1:
            raise ValueError(f"max_buffered_tokens must be >= 1, got {self.max_buffered_tokens}")
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.max_waiting < 0 or self.default_max_tokens < 1:
            raise ValueError("max_waiting must be >= 0 and default_max_tokens >= 1")
        if self.stall_limit_s <= 0:
            raise ValueError(f"stall_limit_s must be > 0, got {self.stall_limit_s}")
        if self.draft_deadline_s <= 0:
            raise ValueError(f"draft_deadline_s must be > 0, got {self.draft_deadline_s}")

    @property
    def name(self) -> str:
        return self.model_name or served_name(self.model.model_dir)  # org/name: a Hub id

    @classmethod
    def of_stack(cls, config: StackConfig, **overrides) -> VerifierOptions:
        """A verifier member of the stack `config` (the Ray actor, `chainspec verifier`);
        `overrides`: fields a stack does not set (model_name, default_max_tokens, ...)."""
        return cls(**{"model": config.local_options("verifier"),
                      "max_waiting": config.max_waiting,
                      "draft_deadline_s": config.draft_deadline_s,
                      "drafter": config.drafter.mode, "groups": config.pipeline_groups,
                      "draft_ahead": config.draft_ahead,
                      "scheduling_policy": config.scheduling_policy, **overrides})


class VerifierServer:
    """A running verifier: its gRPC server, engine and drafter pool (or, in local mode,
    its in-process drafter)."""

    def __init__(self, running: RunningServer, engine: AsyncVerifier,
                 drafts: GrpcDraftClient | LocalDrafts, metrics: VerifierMetrics | None = None,
                 watchdog: EngineWatchdog | None = None) -> None:
        self.running, self.engine, self.drafts = running, engine, drafts
        self.metrics, self.watchdog = metrics, watchdog

    @property
    def failure(self) -> str | None:
        """Why this verifier's engine is out of service (None while it serves)."""
        return self.watchdog.failure if self.watchdog is not None else self.engine.failure

    def link_states(self) -> dict[str, str]:
        """Each wanted drafter endpoint -> its link state (live, connecting, dead, ...)."""
        return {ep: str(state) for ep, state in self.drafts.states().items()}

    @property
    def address(self) -> str:
        return self.running.address

    @property
    def port(self) -> int:
        return self.running.port

    def metrics_url(self, advertise: str | None = None) -> str | None:
        return self.running.metrics_url(advertise)

    @property
    def load(self) -> int:
        return self.engine.running + self.engine.waiting

    def stats(self) -> dict[str, float]:
        """Engine steps and draft-pool counters (wait for drafts, bytes), cumulative; the
        running sequences; the draft wait of speculative rounds (the drafter autoscaler)."""
        core = self.engine.engine
        wait_s, waits = 0.0, 0
        if self.metrics is not None:
            with self.metrics.recorder.lock:  # NOTE: the engine thread observes into it
                wait_s, waits = self.metrics.draft_wait.sum, sum(self.metrics.draft_wait.counts)
        return {"steps": self.engine.steps, "step_s_total": self.engine.step_s_total,
                "ahead_hits": core.ahead_hits, "ahead_misses": core.ahead_misses,
                "running": self.engine.running, "pid": os.getpid(),
                "draft_wait_s_total": wait_s, "draft_waits": waits,
                **asdict(self.drafts.stats)}

    async def set_drafters(self, endpoints: Sequence[str]) -> None:
        """Follow drafters appearing, draining and dying (on the engine thread)."""
        endpoints = tuple(endpoints)
        await self.engine.call(lambda: self.drafts.set_endpoints(endpoints))

    async def drain(self) -> None:
        await self.running.drain()

    async def stop(self) -> None:
        await self.running.stop(0)


async def serve_verifier(opts: VerifierOptions, server: ServerOptions,
                         drafters: Sequence[str] = (),
                         client: ClientOptions | None = None,
                         metrics: VerifierMetrics | None = None,
                         on_failure: Callable[[str], None] | None = None) -> VerifierServer:
    """Load the target, build the engine over a gRPC drafter pool (or, with
    `opts.drafter` local, over an in-process drafter: no wire, `drafters` must be empty),
    start the Verifier service, warm up, then report SERVING. `metrics` observes the
    engine, the pool and the gRPC calls (served on `server.metrics_port` when set). If the
    engine thread dies or stalls, health turns NOT_SERVING and `on_failure(reason)` is
    called once."""
    local = opts.drafter is DrafterMode.LOCAL
    if local and drafters:
        raise ValueError("drafter mode local drafts in process: give no drafter endpoints")
    target, tokenizer = await asyncio.to_thread(_load, opts.model)
    m = opts.model
    fingerprint = model_fingerprint(target)
    if local:
        drafts = local_drafter(await asyncio.to_thread(load_draft, m), m)
    else:
        match = DrafterMatch(m.num_steps, target.config.hidden_size,
                             target.config.vocab_size, fingerprint)  # never another model's
        drafts = GrpcDraftClient((), client or ClientOptions(), opts.draft_deadline_s,
                                 match=match, observer=metrics, max_seqs=m.max_seqs)
    eos = tokenizer.eos_token_ids if tokenizer is not None else ()
    core = build_verifier_engine(target, m, drafts, eos, tokenizer.decode if tokenizer else None,
                                 opts.groups, opts.draft_ahead, opts.scheduling_policy)
    engine = AsyncVerifier(core, opts.max_waiting, opts.max_buffered_tokens)
    if metrics is not None:
        metrics.set_info(m.num_steps, m.dtype, m.chain)
        metrics.attach(core, drafts)
    # NOTE: no position past what the model was built for (its max_position_embeddings,
    # or what its RoPE scaling extends that to), whatever the slots could hold
    limits = GenerateLimits(target.config.vocab_size,
                            min(m.max_len, target.config.position_limit), m.num_steps,
                            opts.default_max_tokens, scheduling_policy=opts.scheduling_policy)
    servicer = VerifierServicer(engine, limits, tokenizer, opts.name, fingerprint,
                                lambda: len(drafts.loads()))
    running = await start_server(server, servicer.register, [VERIFIER_SERVICE], metrics)
    running.add_stop_hook(servicer.close)
    running.add_stop_hook(engine.shutdown)
    running.add_stop_hook(drafts.close)
    watchdog = EngineWatchdog(engine, running, opts.stall_limit_s, on_failure)
    verifier = VerifierServer(running, engine, drafts, metrics, watchdog)
    try:
        await verifier.set_drafters(drafters)
        await asyncio.to_thread(drafts.wait_connected, drafts.connect_timeout_s + 1.0)
        await _warm_up(engine)
    except BaseException:
        await running.stop(0)
        raise
    # NOTE: observed from now on, so the warm-up request is not counted (the engine is
    # idle: the next step reads the new observer)
    core.observer = metrics
    await running.set_serving(True)
    watchdog.start()
    return verifier


def _load(opts: LocalOptions) -> tuple[TargetModel, Tokenizer | None]:
    target = load_target_model(opts)
    has_tokenizer = (Path(opts.model_dir) / "tokenizer.json").is_file()
    return target, Tokenizer.from_dir(opts.model_dir) if has_tokenizer else None


async def _warm_up(engine: AsyncVerifier) -> None:
    """One short request through every engine path (prefill, decode, draft update)."""
    stop = StopConditions(max_tokens=2, ignore_eos=True)
    async for _ in engine.generate(f"warm-up-{uuid.uuid4().hex}", [0],
                                   SamplingParams(temperature=0.0), stop):
        pass

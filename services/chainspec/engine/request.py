"""A generation request and its state inside the verifier."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from chainspec.engine.block_allocator import BlockTable
from chainspec.engine.draft_types import DraftAhead, DraftResult
from chainspec.engine.kv_groups import SeqClaims
from chainspec.engine.logprobs import TokenLogprob


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class StopConditions:
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")


@dataclass
class RequestStats:
    """Per-request speculation counters (vLLM's spec-decode shape)."""

    num_steps: int
    rounds: int = 0  # verify rounds that carried drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallback_rounds: int = 0  # plain decode rows for lack of drafts
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (first admission)
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_steps

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per verify round with drafts (accepted + bonus)."""
        return 1.0 + self.accepted_tokens / self.rounds if self.rounds else 1.0

    def record(self, num_drafts: int, accepted: int) -> None:
        self.rounds += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1


class Request:
    """Committed tokens x[0..N] (x[N] newest, not yet run through the target)."""

    def __init__(self, request_id: str, prompt: list[int], sampling, stop: StopConditions,
                 num_steps: int) -> None:
        self.request_id = request_id
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.sampling = sampling
        # the client chose the seed: its tokens must not depend on load, drafts or faults,
        # so sampled rounds use the coupled rule (DESIGN 3.3, engine/acceptance.py)
        self.seeded = False
        self.stop = stop
        self.blocks = BlockTable()  # KV blocks holding positions < num_computed (and more)
        self.claims = SeqClaims(())  # window tables and state slot (the engine sets them)
        self.recompute_len = 0  # after a preemption: committed positions to prefill again
        # prefix caching (engine/prefix_cache.py): chain hashes of full blocks of `tokens`
        # (as far as computed), positions the last admission read from the cache, and
        # the leading blocks of `blocks` that are cached
        self.block_hashes: list[bytes] = []
        self.hash_root: bytes | None = None  # prefix_cache.salt_root of its cache_salt
        self.prefix_hit = 0
        self.num_cached = 0
        self.preemptions = 0
        self.group = 0  # pipelined group (VerifierConfig.groups), set at admission
        self.party = request_id  # the client request it serves (engine/admission.py)
        self.priority = 0  # lower is admitted first (SchedulingPolicy.PRIORITY)
        self.num_computed = 0  # positions < num_computed have target KV
        self.drafts: DraftResult | None = None  # proposals for the next verify
        self.drafts_ahead = False  # `drafts` came from a look-ahead hit (DESIGN 4.8)
        self.ahead: tuple[DraftAhead, ...] = ()  # look-aheads for the round being verified
        self.drafter_synced = False  # the drafter holds this sequence's state
        self.resync_at: int | None = None  # engine step to retry a refused sequence at
        self.resync_backoff = 4
        # why the sequence last had no drafts ("stale", "resync", "no_drafter"); None once
        # drafts arrive. Metrics label plain-decode fallbacks with it ("late" when None).
        self.draft_miss: str | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_string: str | None = None
        self.error: str | None = None
        self.stats = RequestStats(num_steps)
        self.max_drafts = num_steps  # the request's cap on drafts verified per round
        self.wants_drafts = True  # adaptive depth (4.11): ask the drafter for next round's
        self.grammar = None  # GrammarMatcher over the committed output (structured output)

    @property
    def prefill_len(self) -> int:
        """Positions prefilled before decoding: the prompt, or after a preemption every
        committed position but the newest."""
        return max(self.prompt_len, self.recompute_len)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def draft_budget(self) -> int:
        """Drafts a round can still commit before max_tokens: a window commits its
        accepted drafts and one token more, so with r tokens left, r - 1. NOTE: at 32
        output tokens and K=4 a sequence's last round verified ~2 drafts it could not
        keep (the rows, and an expected-token count that overstated drafting's lead)."""
        return max(0, self.stop.max_tokens - self.num_generated - 1)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    error: str | None = None
    stats: RequestStats | None = None  # set on the final output
    # one per new token when the request asked (SamplingParams.num_logprobs), else None
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

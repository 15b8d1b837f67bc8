"""Batched sampling without host sync: per-request params, target probabilities, seeded
counter-based noise, the exponential race, and top-k-truncated draft distributions.

RNG (DESIGN 3.3 "per-request seeds"): noise is a pure function of
(seed, stream, position, index) -- a counter-based hash, not a stateful generator. A
request's noise therefore does not depend on which other requests share the batch, on
round boundaries, on batch-size padding, or on a process restart, and the whole thing is
plain tensor ops (CUDA-graph capturable). `position` is the absolute sequence position of
the token being decided; `stream` keeps the three consumers independent (see NoiseStream).
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from chainspec.engine.grammar import Grammar

_U32 = 0xFFFFFFFF
_SEED_MIN, _SEED_END = -(1 << 63), 1 << 64
MAX_LOGPROBS = 20  # most alternatives a request may ask for per token
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_PENALTY = 2.0  # OpenAI's range for presence/frequency penalties
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy (1/T overflows)
REPETITION_PENALTY = (0.01, 100.0)  # range that keeps penalized logits finite in float32


class NoiseStream(IntEnum):
    """Independent noise streams of one request. Each (stream, position) is consumed by
    at most one committed decision (docs/design.md, "Sampling and acceptance")."""

    # the target's own race at that position (plain decode, the coupled rule's choice at
    # each row), and the drafter's race over its top-k support there (read at its ids)
    SAMPLE = 0
    ACCEPT = 1  # Leviathan: acceptance uniform of the draft at that position
    RESIDUAL = 2  # Leviathan: residual/bonus race, keyed by the round's first position


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy (and below GREEDY_BELOW, vLLM's rule);
    top_k 0 or -1 = off; top_p in (0, 1]; seed None = a random seed drawn once by
    `resolve_seed`.

    Logits processing (engine/logits_processors.py; 0 / 1.0 / empty = off):
    presence/frequency_penalty in [-2, 2] over generated tokens (OpenAI); repetition_penalty
    in [0.01, 100] (a range that keeps logits finite) over prompt + generated tokens
    (vLLM/HF); logit_bias token id -> bias in [-100, 100] (a mapping is stored as sorted
    pairs); min_p in [0, 1] after temperature; min_tokens: EOS and stop token ids are
    masked until that many tokens were generated.
    num_logprobs: None = no logprobs; n in [0, 20] = the chosen token's and n alternatives.
    grammar: None = free text; else the compiled grammar every token must follow
    (structured output, engine/grammar.py; masked in engine/grammar_mask.py).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    min_p: float = 0.0
    min_tokens: int = 0
    num_logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        self._check_basic()
        if self.temperature < GREEDY_BELOW:  # NOTE: 1e-45 would make logits / T infinite
            object.__setattr__(self, "temperature", 0.0)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r, (r_lo, r_hi) = self.repetition_penalty, REPETITION_PENALTY
        if not _is_number(r) or not r_lo <= r <= r_hi:
            raise ValueError(f"repetition_penalty must be a number in [{r_lo}, {r_hi}], "
                             f"got {r!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        n = self.num_logprobs
        if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
            raise ValueError(f"num_logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {n!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor (engine/logits_processors.py) is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    def _check_basic(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, int | float) or not (
                math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 = off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)
                              or not _SEED_MIN <= s < _SEED_END):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolve_seed(self, draws: random.Random | None = None) -> SamplingParams:
        """Self with a concrete seed; call once at admission so every round agrees.
        `draws`: the engine's seeded source (vLLM's --seed), else fresh randomness."""
        if self.seed is not None:
            return self
        return replace(self, seed=draws.getrandbits(63) if draws else secrets.randbits(63))


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float)


def _is_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias (a mapping or pairs) -> sorted (token id, bias) pairs, validated."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    pairs = []
    for item in items:
        tok, value = item
        if not _is_int(tok) or tok < 0:
            raise ValueError(f"logit_bias token ids must be ints >= 0, got {tok!r}")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], "
                             f"got {value!r} for token {tok}")
        pairs.append((tok, float(value)))
    if len({t for t, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token id twice")
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class SamplingBatch:
    """SamplingParams of B sequences as device tensors, one entry per sequence."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64 (two's complement of the 64-bit seed)
    min_p: torch.Tensor | None = None  # [B] float32; None: no request uses min_p

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    device: torch.device | str = "cpu") -> SamplingBatch:
        seeds = [p.resolve_seed().seed for p in params]
        return cls(
            torch.tensor([float(p.temperature) for p in params], dtype=torch.float32,
                         device=device),
            torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device),
            torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device),
            torch.tensor([s - _SEED_END if s >= 1 << 63 else s for s in seeds],
                         dtype=torch.int64, device=device),
            torch.tensor([float(p.min_p) for p in params], dtype=torch.float32,
                         device=device) if any(p.min_p for p in params) else None)

    def target_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] or [B, T, V] (T rows per sequence) -> p, same shape, float32."""
        per_seq = (self.temperature, self.top_k, self.top_p, self.min_p)
        if logits.dim() == 2:
            return target_probs(logits, *per_seq)
        b, t, v = logits.shape
        rows = [None if x is None else x.repeat_interleave(t) for x in per_seq]
        return target_probs(logits.reshape(b * t, v), *rows).reshape(b, t, v)


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] -> p [R, V] float32 after temperature, then min-p (drop tokens whose
    probability is below min_p times the top one's), then top-k, then top-p (on the
    renormalized distribution), per row (vLLM's order). temperature 0 -> one-hot argmax
    (first index on ties). Top-k keeps exactly k tokens (sort order breaks ties)."""
    logits = logits.float()
    greedy = temperature <= 0  # [R]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    sorted_logits, order = (logits / temp[:, None]).sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(logits.shape[-1], device=logits.device)  # [V]
    keep = (top_k[:, None] <= 0) | (rank[None, :] < top_k[:, None])  # [R, V]
    if min_p is not None:  # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        floor = sorted_logits[:, :1] + torch.log(min_p[:, None])  # [R, 1]; -inf for 0
        keep = keep & (sorted_logits >= floor)
    sorted_logits = sorted_logits.masked_fill(~keep, -math.inf)
    sorted_probs = sorted_logits.softmax(dim=-1)  # [R, V]
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each rank
    # NOTE: top_p >= 1 keeps everything even when float cumsum overshoots 1.
    keep = keep & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    masked = torch.full_like(logits, -math.inf).scatter(
        -1, order, sorted_logits.masked_fill(~keep, -math.inf))
    probs = masked.softmax(dim=-1)  # [R, V]
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(w / E) with E ~ Exp(1) picks index i with probability
    w_i / sum(w), so `probs` [R, W] may be unnormalized weights. noise [R, W] -> [R] int64.
    One-hot rows return their hot index; zero-weight entries never win (w has a positive
    entry in every row)."""
    return (probs / noise).argmax(dim=-1)


def uniform(seed: torch.Tensor, stream: int, position: torch.Tensor,
            width: int) -> torch.Tensor:
    """U(0, 1) noise [*S, width] float32, a pure function of (seed, stream, position, index).
    seed, position: int64, broadcastable to [*S]. 23-bit resolution, never 0 or 1."""
    return uniform_at(seed, stream, position, torch.arange(width, device=seed.device))


def uniform_at(seed: torch.Tensor, stream: int, position: torch.Tensor,
               index: torch.Tensor) -> torch.Tensor:
    """`uniform` read at the given indices only: index int64 [*S, W] (or [W]) in
    [0, 2**32) -> [*S, W], equal to uniform(..., width)[..., index] for any width."""
    key = _mix32((seed & _U32) ^ 0x9E3779B9)
    key = _mix32(key ^ ((seed >> 32) & _U32) ^ ((int(stream) + 1) * 0x85EBCA77 & _U32))
    key = _mix32(key ^ (position & _U32))  # [*S]
    step = _mul32(index.to(key.device), 0x9E3779B9)  # [*S, W], Weyl step
    bits = _mix32((key[..., None] + step) & _U32)  # [*S, W]
    return ((bits >> 9).float() + 0.5) * 2.0 ** -23


def exponential_noise(seed: torch.Tensor, stream: int, position: torch.Tensor,
                      width: int) -> torch.Tensor:
    """Exp(1) noise [*S, width] float32 for `sample`, keyed like `uniform`."""
    return -uniform(seed, stream, position, width).log()


def exponential_noise_at(seed: torch.Tensor, stream: int, position: torch.Tensor,
                         index: torch.Tensor) -> torch.Tensor:
    """`exponential_noise` read at the given indices only (see `uniform_at`)."""
    return -uniform_at(seed, stream, position, index).log()


def draft_topk(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
               position: torch.Tensor, top_k: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft distribution q truncated to its top k tokens and renormalized, after draft
    temperature; rows with temperature 0 get a point mass on the top token. The draft is
    the race over that support with the target's own noise at the draft's position
    (SAMPLE stream, read at the support's token ids), so where q is close to p the draft
    is the token the target picks there (the coupled rule, engine/acceptance.py).
    logits [R, V], temperature [R], seed [R] int64, position [R] (the draft's) ->
    token [R] int64, support [R, k] int64 (descending), probs [R, k] float32 (q over support).
    """
    k = min(top_k, logits.shape[-1])
    greedy = temperature <= 0  # [R]
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    top_logits, support = (logits.float() / temp[:, None]).topk(k, dim=-1)  # [R, k]
    point = torch.zeros_like(top_logits)
    point[:, 0] = 1.0
    probs = torch.where(greedy[:, None], point, top_logits.softmax(dim=-1))  # [R, k]
    noise = exponential_noise_at(seed, NoiseStream.SAMPLE, position, support)  # [R, k]
    pick = sample(probs, noise)  # [R]
    return support.gather(1, pick[:, None]).squeeze(1), support, probs


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow (16-bit halves)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _U32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32 on int64 tensors holding values in [0, 2**32): a bijection with
    full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)

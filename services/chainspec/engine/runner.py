"""Drive a verifier engine until a set of requests completes (CLI, benchmarks, tests)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from chainspec.engine.request import FinishReason, RequestStats, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.verifier import VerifierEngine


@dataclass
class Completion:
    tokens: list[int]
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    error: str | None = None


@dataclass(frozen=True)
class RunResult:
    completions: list[Completion]
    seconds: float
    steps: int

    @property
    def generated_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)


def run_to_completion(engine: VerifierEngine, prompts: Sequence[Sequence[int]],
                      sampling: SamplingParams | Sequence[SamplingParams],
                      stop: StopConditions) -> RunResult:
    """Submit every prompt at once and step until all finish."""
    params = sampling if isinstance(sampling, Sequence) else [sampling] * len(prompts)
    completions = [Completion([]) for _ in prompts]
    ids = [f"run-{id(completions)}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p, stop)
    steps, t0 = 0, time.perf_counter()
    while engine.has_work:
        for out in engine.step():
            c = completions[index[out.request_id]]
            c.tokens.extend(out.new_tokens)
            if out.finished:
                c.finish_reason, c.stats, c.error = out.finish_reason, out.stats, out.error
        steps += 1
    return RunResult(completions, time.perf_counter() - t0, steps)


def merged_stats(completions: Sequence[Completion], num_steps: int) -> RequestStats:
    total = RequestStats(num_steps)
    for c in completions:
        if c.stats is None:
            continue
        total.rounds += c.stats.rounds
        total.draft_tokens += c.stats.draft_tokens
        total.accepted_tokens += c.stats.accepted_tokens
        total.fallback_rounds += c.stats.fallback_rounds
        for i, n in enumerate(c.stats.accepted_per_pos):
            total.accepted_per_pos[i] += n
    return total

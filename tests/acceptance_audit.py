"""Acceptance is a correctness property (DESIGN 3.5): an engine's per-position
acceptance on held-out prompts must equal the offline simulation of the same modules
(`training.evaluate.simulate_rounds`: the same greedy rounds, each drafted from scratch
over the committed prefix) within 0.02. A chain step that reads the wrong hidden state,
a layer index never advanced or a buffer the step never reads keeps outputs right and
moves these rates, so every family and every mode runs this check."""

from __future__ import annotations

from collections.abc import Sequence

from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.verifier import VerifierEngine
from chainspec.training.evaluate import Acceptance

TOLERANCE = 0.02


def engine_acceptance(eng: VerifierEngine, prompts: Sequence[Sequence[int]], max_new: int,
                      batch: int = 4) -> Acceptance:
    """Greedy generation of `max_new` tokens per prompt (no EOS), counted per position."""
    stop = StopConditions(max_tokens=max_new, ignore_eos=True)
    completions = []
    for i in range(0, len(prompts), batch):
        result = run_to_completion(eng, prompts[i:i + batch], SamplingParams(temperature=0.0),
                                   stop)
        completions += result.completions
    stats = merged_stats(completions, eng.config.num_steps)
    assert stats.fallback_rounds == 0, "every round had its drafts (else rates differ)"
    return Acceptance(stats.rounds, tuple(stats.accepted_per_pos))


def rate_gaps(got: Acceptance, want: Acceptance) -> list[float]:
    """|engine - offline| per draft position."""
    return [abs(a - b) for a, b in zip(got.rates, want.rates, strict=True)]


def assert_acceptance_matches(got: Acceptance, want: Acceptance) -> None:
    gaps = rate_gaps(got, want)
    assert max(gaps) <= TOLERANCE, (
        f"engine per-position acceptance {[round(r, 3) for r in got.rates]} "
        f"({got.rounds} rounds) vs offline {[round(r, 3) for r in want.rates]} "
        f"({want.rounds} rounds)")

"""`chainspec bench`: the same prompts, speculative and plain, interleaved, one run."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer

FALLBACK_PROMPTS = ("def fibonacci(n):", "import os\n", "class Config:\n", "for i in range(")


@dataclass(frozen=True)
class BenchOptions:
    num_prompts: int = 20
    batch_size: int = 1
    max_tokens: int = 64
    repeats: int = 1
    warmup: int = 1

    def __post_init__(self) -> None:
        for name in ("num_prompts", "batch_size", "max_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def load_prompts(model_dir: Path, count: int) -> list[str]:
    """Held-out prompts shipped with the model (`heldout_prompts.json`), cycled to `count`."""
    path = Path(model_dir) / "heldout_prompts.json"
    prompts = json.loads(path.read_text()) if path.exists() else list(FALLBACK_PROMPTS)
    return [prompts[i % len(prompts)] for i in range(count)]


def run_bench(local: LocalOptions, bench: BenchOptions) -> dict:
    tok = Tokenizer.from_dir(local.model_dir)
    models = load_models(local, speculative=True)
    engines = {spec: build_verifier(models, local, spec, tok.eos_token_ids)
               for spec in (True, False)}
    prompts = [tok.encode(p) for p in load_prompts(local.model_dir, bench.num_prompts)]
    greedy, stop = SamplingParams(temperature=0.0), StopConditions(max_tokens=bench.max_tokens,
                                                                   ignore_eos=True)
    batches = [prompts[i:i + bench.batch_size] for i in range(0, len(prompts),
                                                                bench.batch_size)]
    for spec in (True, False):  # warm-up: first-call allocations and thread pools
        for batch in batches[: bench.warmup]:
            run_to_completion(engines[spec], batch, greedy, stop)
    seconds = {True: 0.0, False: 0.0}
    tokens = {True: 0, False: 0}
    outputs: dict[bool, list] = {True: [], False: []}
    spec_completions = []
    for _ in range(bench.repeats):
        for batch in batches:
            for spec in (True, False):  # interleaved, so drift hits both modes alike
                result = run_to_completion(engines[spec], batch, greedy, stop)
                seconds[spec] += result.seconds
                tokens[spec] += result.generated_tokens
                outputs[spec].extend(c.tokens for c in result.completions)
                if spec:
                    spec_completions.extend(result.completions)
    stats = merged_stats(spec_completions, local.num_steps)
    return _report(local, bench, seconds, tokens, outputs, stats)


def _report(local, bench, seconds, tokens, outputs, s) -> dict:
    rounds = max(s.rounds, 1)
    spec_tps, plain_tps = tokens[True] / seconds[True], tokens[False] / seconds[False]
    return {
        "model": str(local.model_dir),
        "k": local.num_steps,
        "chain": local.chain,
        "batch_size": bench.batch_size,
        "num_prompts": bench.num_prompts,
        "max_tokens": bench.max_tokens,
        "acceptance_length": round(1 + s.accepted_tokens / rounds, 4),
        "accepted_per_position": [round(n / rounds, 4) for n in s.accepted_per_pos],
        "draft_tokens": s.draft_tokens,
        "accepted_tokens": s.accepted_tokens,
        "rounds": s.rounds,
        "spec_tokens_per_s": round(spec_tps, 2),
        "plain_tokens_per_s": round(plain_tps, 2),
        "speedup": round(spec_tps / plain_tps, 4),
        "lossless": outputs[True] == outputs[False],
    }


def format_report(r: dict) -> str:
    per_pos = " ".join(f"{x:.2f}" for x in r["accepted_per_position"])
    return (f"K={r['k']} chain={r['chain']} batch={r['batch_size']} prompts={r['num_prompts']} "
            f"max_tokens={r['max_tokens']}\n"
            f"acceptance length  {r['acceptance_length']:.2f}  (per position: {per_pos})\n"
            f"speculative        {r['spec_tokens_per_s']:.1f} tok/s\n"
            f"plain              {r['plain_tokens_per_s']:.1f} tok/s\n"
            f"speedup            {r['speedup']:.2f}x   lossless: {r['lossless']}")

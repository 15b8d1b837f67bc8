"""Adaptive draft depth (DESIGN 4.11) against fixed K and plain, in one run, in process.

The same held-out prompts, greedy, through three engines built over the same loaded demo
model: plain, speculative at fixed K, speculative at adaptive depth (max K). Batches are
interleaved across the three, in rotating order, so drift hits each alike. The adaptive
engine is kept across batch sizes (its estimates carry over, as under a load that
changes).

    .venv/bin/python benchmarks/adaptive_depth.py --batch-sizes 1 16 --repeats 2
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from pathlib import Path

import torch

from chainspec.bench import load_prompts
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer

OUT = Path(__file__).parent / "results"
MODES = ("plain", "fixed", "adaptive")


class DepthTally:
    """Counts the depth of every verify window (wraps the engine's choice)."""

    def __init__(self, engine) -> None:
        self.counts: collections.Counter = collections.Counter()
        inner = engine._choose_depths

        def choose(work):
            out = inner(work)
            self.counts.update(w.num_drafts for w in out if w.kind.value == "verify")
            return out
        engine._choose_depths = choose


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(OUT / "adaptive_depth"))
    args = p.parse_args()
    torch.set_num_threads(1)
    base = LocalOptions(DEMO_MODEL, num_steps=args.k, max_seqs=max(args.batch_sizes),
                        max_len=512)
    tok = Tokenizer.from_dir(DEMO_MODEL)
    models = load_models(base, speculative=True)
    engines = {
        "plain": build_verifier(models, base, False, tok.eos_token_ids),
        "fixed": build_verifier(models, base, True, tok.eos_token_ids),
        "adaptive": build_verifier(models, dataclasses.replace(
            base, speculative_depth="adaptive"), True, tok.eos_token_ids),
    }
    tallies = {m: DepthTally(e) for m, e in engines.items() if m != "plain"}
    prompts = [tok.encode(t) for t in load_prompts(DEMO_MODEL, args.prompts)]
    greedy = SamplingParams(temperature=0.0)
    stop = StopConditions(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for bs in args.batch_sizes:
        batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
        for mode in MODES:  # warm-up (the adaptive policy also learns here)
            run_to_completion(engines[mode], batches[0], greedy, stop)
        for t in tallies.values():
            t.counts.clear()
        seconds = dict.fromkeys(MODES, 0.0)
        tokens = dict.fromkeys(MODES, 0)
        outputs: dict[str, list] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for j, batch in enumerate(batches):
                for mode in MODES[j % 3:] + MODES[:j % 3]:  # rotated: no mode always last
                    r = run_to_completion(engines[mode], batch, greedy, stop)
                    seconds[mode] += r.seconds
                    tokens[mode] += r.generated_tokens
                    outputs[mode] += [c.tokens for c in r.completions]
        tps = {m: tokens[m] / seconds[m] for m in MODES}
        row = {"batch_size": bs, "tokens_per_s": {m: round(v, 1) for m, v in tps.items()},
               "fixed_over_plain": round(tps["fixed"] / tps["plain"], 3),
               "adaptive_over_plain": round(tps["adaptive"] / tps["plain"], 3),
               "adaptive_over_best": round(tps["adaptive"] / max(tps["plain"], tps["fixed"]), 3),
               "adaptive_depths": {str(k): tallies["adaptive"].counts[k]
                                   for k in range(args.k + 1)},
               "lossless": outputs["fixed"] == outputs["plain"] == outputs["adaptive"]}
        rows.append(row)
        print(json.dumps(row))
    report = {"model": "demo", "k": args.k, "prompts": args.prompts,
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# Adaptive draft depth vs fixed K={args.k} vs plain (demo model, in process)",
             "", f"{args.prompts} held-out prompts, greedy, {args.max_tokens} tokens, "
             f"{args.repeats} repeats interleaved; `benchmarks/adaptive_depth.py`.", "",
             "| batch | plain tok/s | fixed tok/s | adaptive tok/s | fixed/plain | "
             "adaptive/plain | adaptive/best | adaptive depths 0..K | lossless |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tokens_per_s"]
        depths = " / ".join(str(v) for v in r["adaptive_depths"].values())
        lines.append(f"| {r['batch_size']} | {t['plain']} | {t['fixed']} | {t['adaptive']} | "
                     f"{r['fixed_over_plain']} | {r['adaptive_over_plain']} | "
                     f"{r['adaptive_over_best']} | {depths} | {r['lossless']} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

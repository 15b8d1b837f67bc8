"""Acceptance cost of the coupled rule (seeded requests) against Leviathan's (unseeded).

The same held-out prompts of the demo model, the same seeds, K = 3, in process: once with
the coupled rule (a draft is accepted iff it equals the target's own keyed race at its row)
and once with Leviathan's min(1, p/q) rule, at temperature 0.8 and 1.0. Drafts are the
same in both arms (top-k sampled on the target's noise); only the rule differs. Reports
accepted drafts per round and per position. Usage:
python benchmarks/seeded_acceptance.py [--prompts 32] [--max-tokens 64] [--reps 4]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from chainspec.bench import load_prompts
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import Completion, merged_stats
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer

RULES = {"coupled": True, "leviathan": False}  # rule -> Request.seeded


def run(eng, prompts, temperature: float, seeds, seeded: bool, stop) -> list[Completion]:
    """run_to_completion, with each request's rule set explicitly (same seeds either way)."""
    done = [Completion([]) for _ in prompts]
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        eng.add_request(str(i), prompt, SamplingParams(temperature=temperature, seed=seed),
                        stop)
        eng.by_id[str(i)].seeded = seeded
    while eng.has_work:
        for out in eng.step():
            c = done[int(out.request_id)]
            c.tokens.extend(out.new_tokens)
            if out.finished:
                c.stats = out.stats
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    opts = LocalOptions(DEMO_MODEL, num_steps=3, max_seqs=16, max_len=512)
    models = load_models(opts, speculative=True)
    tok = Tokenizer.from_dir(DEMO_MODEL)
    prompts = [tok.encode(t) for t in load_prompts(DEMO_MODEL, args.prompts)]
    stop = StopConditions(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for temperature in (0.8, 1.0):
        for rule, seeded in RULES.items():
            rounds = accepted = 0
            per_pos = [0] * opts.num_steps
            for rep in range(args.reps):
                seeds = [1000 * rep + i for i in range(len(prompts))]
                done = run(build_verifier(models, opts, True), prompts, temperature, seeds,
                           seeded, stop)
                s = merged_stats(done, opts.num_steps)
                rounds += s.rounds
                accepted += s.accepted_tokens
                per_pos = [a + b for a, b in zip(per_pos, s.accepted_per_pos, strict=True)]
            rows.append({"temperature": temperature, "rule": rule, "rounds": rounds,
                         "accepted_per_round": round(accepted / rounds, 4),
                         "tokens_per_round": round(1 + accepted / rounds, 4),
                         "accept_rate_per_position": [round(a / rounds, 4) for a in per_pos]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    json.dump({"k": opts.num_steps, "prompts": len(prompts), "max_tokens": args.max_tokens,
               "reps": args.reps, "draft_top_k": opts.draft_top_k, "rows": rows},
              sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Extreme-value requests against a whole stack (issue 19, "Must show"): N random bodies
with zero, denormal, float32/float64-edge and out-of-range values in every numeric
parameter of both endpoints, streamed and not, sent through HTTP -> gateway -> verifier
-> drafter (gRPC on loopback, in this process, the demo model by default). Every answer
is checked as tests/integration/extreme_requests.py says: no 5xx, strict finite JSON in
every body and SSE event, logprobs in [-9999, 0], a 400 naming a parameter of the body,
greedy answers equal to plain decoding, echo with max_tokens 0 the prompt alone.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/extreme_values.py \\
        [--requests 2000] [--seed 0] [--model DIR] [--out benchmarks/results]

Writes extreme_values.json and extreme_values.md under --out; exit 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from chainspec.engine.local import DEMO_MODEL  # noqa: E402
from chainspec.models.tokenizer import Tokenizer  # noqa: E402
from tests.integration.extreme_requests import (  # noqa: E402
    Plain,
    Tally,
    random_request,
    run_one,
    start_stack,
)
from tests.integration.helpers import LoopThread  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=DEMO_MODEL)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    vocab = Tokenizer.from_dir(args.model).vocab_size
    rng, tally, loop = random.Random(args.seed), Tally(), LoopThread()
    stack = start_stack(loop, args.model)
    plain = Plain(args.model)
    t0 = time.perf_counter()
    try:
        with httpx.Client(base_url=stack.url, timeout=60) as client:
            for _ in range(args.requests):
                run_one(client, plain, *random_request(rng, vocab), tally)
    finally:
        stack.stop()
        loop.close()
    seconds = time.perf_counter() - t0
    result = {"requests": args.requests, "seed": args.seed, "model": args.model.name,
              "seconds": round(seconds, 1),
              "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
              "server_errors": sum(v for k, v in tally.statuses.items() if k >= 500),
              "streamed": tally.streamed, "greedy_compared_to_plain": tally.greedy_compared,
              "echo_prompt_only": tally.prompt_only, "failed_checks": len(tally.failures),
              "failures": tally.failures[:20]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "extreme_values.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "extreme_values.md").write_text(markdown(result))
    print(markdown(result))
    return 1 if tally.failures else 0


def markdown(r: dict) -> str:
    statuses = ", ".join(f"{v} x {k}" for k, v in r["statuses"].items())
    return (f"# Extreme-value requests through the whole stack\n\n"
            f"`benchmarks/extreme_values.py --requests {r['requests']} --seed {r['seed']}` "
            f"on the {r['model']} model (HTTP -> gateway -> verifier -> drafter, loopback), "
            f"{r['seconds']} s.\n\n"
            f"| what | count |\n|---|---|\n"
            f"| requests | {r['requests']} |\n| answers | {statuses} |\n"
            f"| 5xx | {r['server_errors']} |\n| streamed | {r['streamed']} |\n"
            f"| greedy answers equal to plain decoding (checked) | "
            f"{r['greedy_compared_to_plain']} |\n"
            f"| echo with max_tokens 0 (the prompt alone) | {r['echo_prompt_only']} |\n"
            f"| failed checks (5xx, non-finite or non-strict JSON, unnamed 400, greedy "
            f"mismatch) | {r['failed_checks']} |\n")


if __name__ == "__main__":
    sys.exit(main())

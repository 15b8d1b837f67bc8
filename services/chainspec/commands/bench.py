"""`chainspec bench`: speculative vs plain on the same prompts, in one run, in this process;
`chainspec bench serve`: a load test of a running server (`commands/bench_serve.py`)."""

from __future__ import annotations

import argparse
import json

from chainspec.commands import bench_serve
from chainspec.commands.help_format import DefaultsHelpFormatter
from chainspec.commands.model_args import TP_KEYS, add_model_args, local_options


def add_parser(sub) -> list[str]:
    p = sub.add_parser("bench", help="speculative vs plain on the same prompts, one run")
    add_model_args(p, TP_KEYS)
    p.add_argument("--prompts", type=int, default=20, help="number of prompts")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # NOTE: optional, so `chainspec bench --json -k 3` parses as it always did
    modes = p.add_subparsers(dest="bench_mode", metavar="{serve}")
    bench_serve.add_arguments(modes.add_parser(
        "serve", help="load-test an OpenAI-compatible server", description=bench_serve.__doc__,
        formatter_class=DefaultsHelpFormatter))
    return ["bench"]


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_mode", None) == "serve":
        return bench_serve.run(args)
    from chainspec.bench import BenchOptions, format_report, run_bench

    report = run_bench(local_options(args), BenchOptions(args.prompts, args.batch_size,
                                                         args.max_tokens, args.repeats))
    print(json.dumps(report) if args.json else format_report(report))
    return 0

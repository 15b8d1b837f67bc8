"""The `chainspec` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from chainspec.engine.local import DEMO_MODEL, DTYPES, LocalOptions

SUBCOMMANDS = ("generate", "bench", "train-demo")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEMO_MODEL,
                   help="Hugging Face model directory (default: the bundled demo model)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=3,
                   help="draft tokens per round (K)")
    p.add_argument("--no-chain", dest="chain", action="store_false",
                   help="every MTP step reads the target hidden state (non-chain mode)")
    p.add_argument("--max-seqs", type=int, default=8, help="sequence slots")
    p.add_argument("--max-len", type=int, default=1024, help="context length per slot")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")


def _local(args: argparse.Namespace) -> LocalOptions:
    return LocalOptions(args.model, args.k, args.chain, args.max_seqs, args.max_len,
                        args.dtype, args.device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chainspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate in one process (speculative by default)")
    _model_args(gen)
    gen.add_argument("--prompt", action="append", required=True,
                     help="prompt text (repeat for a batch)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--no-spec", dest="spec", action="store_false",
                     help="plain decoding, no drafter")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    bench = sub.add_parser("bench", help="speculative vs plain on the same prompts, one run")
    _model_args(bench)
    bench.add_argument("--prompts", type=int, default=20, help="number of prompts")
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    train = sub.add_parser("train-demo", help="train the bundled demo model",
                           add_help=False)
    train.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            from chainspec.commands.generate import generate
            return generate(args, _local(args))
        if args.command == "bench":
            from chainspec.bench import BenchOptions, format_report, run_bench
            report = run_bench(_local(args), BenchOptions(args.prompts, args.batch_size,
                                                          args.max_tokens, args.repeats))
            print(json.dumps(report) if args.json else format_report(report))
            return 0
        if args.command == "train-demo":
            from chainspec.training.trainer import main as train_main
            return train_main(args.args)
    except (ValueError, OSError) as e:
        print(f"chainspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())

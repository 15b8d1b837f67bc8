"""`chainspec train-demo`: train the bundled demo model (see its model card)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> list[str]:
    p = sub.add_parser("train-demo", help="train the bundled demo model", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    return ["train-demo"]


def run(args: argparse.Namespace) -> int:
    from chainspec.training.trainer import main
    return main(args.args)

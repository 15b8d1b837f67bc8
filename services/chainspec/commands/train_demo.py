"""`chainspec train-demo`: train the bundled demo model (see its model card)."""

from __future__ import annotations

import argparse
import shlex
import sys


def add_parser(sub) -> list[str]:
    # NOTE: the trainer's own parser reads the arguments (in `run`): building it imports
    # torch, which no other command's --help should wait for. "+" as the prefix makes
    # every argument, --help included, the trainer's.
    p = sub.add_parser("train-demo", help="train the bundled demo model", add_help=False,
                       prefix_chars="+")
    p.add_argument("trainer_args", nargs=argparse.REMAINDER)
    return ["train-demo"]


def run(args: argparse.Namespace) -> int:
    from chainspec.training import trainer

    parsed = trainer.build_parser().parse_args(args.trainer_args)
    return trainer.run(parsed, "chainspec " + shlex.join(sys.argv[1:]))

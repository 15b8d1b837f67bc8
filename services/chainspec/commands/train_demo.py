"""`chainspec train-demo`: train the bundled demo model (see its model card)."""

from __future__ import annotations

import argparse
import shlex
import sys

from chainspec.training.trainer_args import DESCRIPTION, add_arguments


def add_parser(sub) -> list[str]:
    p = sub.add_parser("train-demo", help="train the bundled demo model",
                       description=DESCRIPTION)
    add_arguments(p)
    return ["train-demo"]


def run(args: argparse.Namespace) -> int:
    from chainspec.training import trainer  # NOTE: torch loads here, not for --help

    return trainer.run(args, "chainspec " + shlex.join(sys.argv[1:]))

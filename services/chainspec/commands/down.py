"""`chainspec down`: stop a running stack (every member, the controller, and the
embedded Ray of the `chainspec up` process that started it)."""

from __future__ import annotations

import argparse
import json
import sys

from chainspec.commands.stack_args import add_connect_args, namespace


def add_parser(sub) -> list[str]:
    p = sub.add_parser("down", help="stop a running stack", description=__doc__)
    add_connect_args(p)
    return ["down"]


def run(args: argparse.Namespace) -> int:
    from chainspec.cluster import stack  # NOTE: Ray loads here, not for --help

    if args.dry_run:
        print(json.dumps({"command": "down", "address": args.address,
                          "namespace": namespace(args)}, indent=2))
        return 0
    try:
        stack.down(args.address, namespace(args))
    except stack.StackError as e:
        print(f"chainspec down: {e}", file=sys.stderr)
        return 1
    target = stack.target_of(namespace(args))
    if args.json:
        print(json.dumps({"address": target.address, "namespace": target.namespace,
                          "stopped": True}, indent=2))
    else:
        print(f"stopped {target}")
    return 0

"""`chainspec status`: the members of a running stack (from any process)."""

from __future__ import annotations

import argparse
import json
import sys

from chainspec.commands.stack_args import add_connect_args, namespace, print_members


def add_parser(sub) -> list[str]:
    p = sub.add_parser("status", help="show the members of a running stack",
                       description="Members with role, endpoint, state, load, pid, node and "
                                   "metrics_url, after a line naming the stack and one on "
                                   "drafter autoscaling (policy, last decision); --json "
                                   "prints {\"address\", \"namespace\", \"autoscale\", "
                                   "\"members\": [...]}.")
    add_connect_args(p)
    return ["status"]


def run(args: argparse.Namespace) -> int:
    from chainspec.cluster import stack  # NOTE: Ray loads here, not for --help

    if args.dry_run:
        print(json.dumps({"command": "status", "address": args.address,
                          "namespace": namespace(args)}, indent=2))
        return 0
    try:
        members = stack.status(args.address, namespace(args))
        autoscale = stack.autoscale_state(args.address, namespace(args))
    except stack.StackError as e:
        print(f"chainspec status: {e}", file=sys.stderr)
        return 1
    print_members(members, args.json, stack.target_of(namespace(args)), autoscale)
    return 0

"""`chainspec scale drafters|verifiers N`: start or drain actors of a running stack."""

from __future__ import annotations

import argparse
import json
import sys

from chainspec.cluster import stack
from chainspec.commands.stack_args import add_connect_args, namespace, print_members

ROLES = {"drafters": "drafter", "verifiers": "verifier"}


def add_parser(sub) -> list[str]:
    p = sub.add_parser("scale", help="change the number of drafters or verifiers",
                       description="Scale-up waits until the new actors serve; scale-down "
                                   "drains (no new work, sequences move, in-flight requests "
                                   "finish) before the actors exit.")
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("replicas", type=int)
    p.add_argument("--no-wait", dest="wait", action="store_false",
                   help="return at once instead of waiting for the new members or drains")
    add_connect_args(p)
    return ["scale"]


def run(args: argparse.Namespace) -> int:
    if args.replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {args.replicas}")
    if args.dry_run:
        print(json.dumps({"command": "scale", "role": ROLES[args.role],
                          "replicas": args.replicas, "wait": args.wait,
                          "address": args.address, "namespace": namespace(args)}, indent=2))
        return 0
    try:
        members = stack.scale(ROLES[args.role], args.replicas, args.address, namespace(args),
                              args.wait)
    except stack.StackError as e:
        print(f"chainspec scale: {e}", file=sys.stderr)
        return 1
    print_members(members, args.json, stack.target_of(namespace(args)))
    return 0

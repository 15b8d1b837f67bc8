"""`chainspec scale drafters|verifiers N`: start or drain actors of a running stack;
`chainspec scale drafters auto:MIN-MAX`: let the controller scale drafters with the load
(a fixed N turns that off again)."""

from __future__ import annotations

import argparse
import json
import sys

from chainspec.commands.stack_args import add_connect_args, autoscale_line, namespace, print_members
from chainspec.commands.stack_flags import drafter_count

ROLES = {"drafters": "drafter", "verifiers": "verifier"}


def add_parser(sub) -> list[str]:
    p = sub.add_parser("scale", help="change the number of drafters or verifiers",
                       description="Scale-up waits until the new actors serve; scale-down "
                                   "drains (no new work, sequences move, in-flight requests "
                                   "finish) before the actors exit. Drafters also take "
                                   "auto:MIN-MAX (autoscaling; a fixed N ends it).")
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("replicas", type=drafter_count, metavar="N|auto:MIN-MAX")
    p.add_argument("--no-wait", dest="wait", action="store_false",
                   help="return at once instead of waiting for the new members or drains")
    add_connect_args(p)
    return ["scale"]


def run(args: argparse.Namespace) -> int:
    from chainspec.cluster import stack  # NOTE: Ray loads here, not for --help

    if not isinstance(args.replicas, int):
        return _autoscale(args, *args.replicas)
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


def _autoscale(args: argparse.Namespace, low: int, high: int) -> int:
    from chainspec.cluster import stack  # NOTE: Ray loads here, not for --help

    if ROLES[args.role] != "drafter":
        raise ValueError("only drafters autoscale; give verifiers a count")
    policy = {"min_drafters": low, "max_drafters": high}  # other fields: the stack's
    if args.dry_run:
        print(json.dumps({"command": "scale", "role": "drafter", "autoscale": policy,
                          "address": args.address, "namespace": namespace(args)}, indent=2))
        return 0
    try:
        state = stack.set_autoscale(policy, args.address, namespace(args))
    except stack.StackError as e:
        print(f"chainspec scale: {e}", file=sys.stderr)
        return 1
    print(json.dumps(state, indent=2) if args.json else autoscale_line(state))
    return 0

"""`chainspec drain MEMBER...` / `chainspec drain --self`: drain members of a running stack
now and wait until they are gone (no new work, a drafter's sequences move to the other
drafters, calls in flight finish). The desired counts stay, so each drained member gets
a replacement that waits for room. The chart's preStop hook runs `drain --self` in a
worker pod that is about to stop (a `helm upgrade` with fewer replicas), so its member
leaves before the pod does."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from chainspec.cluster.config import ROLES
from chainspec.commands.stack_args import add_connect_args, namespace, print_members

NODE_IP_ENV = "CHAINSPEC_NODE_IP"  # the chart sets it to the pod's IP (downward API)


def add_parser(sub) -> list[str]:
    p = sub.add_parser("drain", help="drain members now (e.g. of a pod about to stop)",
                       description=__doc__)
    p.add_argument("members", nargs="*", metavar="MEMBER",
                   help="member ids as `status` shows them (drafter-0, verifier-1, ...)")
    p.add_argument("--self", dest="this_node", action="store_true",
                   help=f"the members on this node: ${NODE_IP_ENV}, else this host's IP")
    p.add_argument("--role", choices=ROLES, help="with --self: only members of this role")
    add_connect_args(p)
    return ["drain"]


def run(args: argparse.Namespace) -> int:
    from chainspec.cluster import stack  # NOTE: Ray loads here, not for --help

    if bool(args.members) == args.this_node:
        raise ValueError("name the members to drain, or give --self (not both)")
    if args.dry_run:
        print(json.dumps({"command": "drain", "members": args.members,
                          "self": args.this_node, "role": args.role,
                          "address": args.address, "namespace": namespace(args)}, indent=2))
        return 0
    try:
        ids = args.members or on_node(stack.status(args.address, namespace(args)),
                                      node_ip(), args.role)
        if not ids:
            print(f"chainspec drain: no member on {node_ip()} in "
                  f"{stack.target_of(namespace(args))}; nothing to drain")
            return 0
        members = stack.drain(ids, args.address, namespace(args))
    except stack.StackError as e:
        print(f"chainspec drain: {e}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"drained {', '.join(ids)}")
    print_members(members, args.json, stack.target_of(namespace(args)))
    return 0


def on_node(members: list[dict[str, Any]], node: str, role: str | None) -> list[str]:
    """The ids of the drafters/verifiers on `node` (of `role`, if given) not draining."""
    roles = (role,) if role else ROLES
    return [m["member_id"] for m in members
            if m["node"] == node and m["role"] in roles and m["state"] != "draining"]


def node_ip() -> str:
    if ip := os.environ.get(NODE_IP_ENV):
        return ip
    import ray

    return ray.util.get_node_ip_address()

"""Arguments shared by the stack commands (`up`, `status`, `scale`, `down`)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from chainspec.commands.server_args import jsonable
from chainspec.commands.stack_flags import file_with_flags, flag_names, where
from chainspec.spine.sections import StackSection

if TYPE_CHECKING:
    from chainspec.cluster.config import StackConfig

NAMESPACE = StackSection.model_fields["namespace"].default


def add_connect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="Ray address of the stack's cluster (`auto`: the local Ray); "
                        "default: the namespace's state file, written by `up`/`serve`. "
                        "Without either the command refuses: it never guesses a stack")
    p.add_argument("--namespace", default=None, help=f"Ray namespace (default: {NAMESPACE})")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the arguments and print them; connect to nothing")


def stack_config(args: argparse.Namespace) -> StackConfig:
    """The --config file (if any) with the stack flags on top, validated (`up`): every
    problem one line naming the key and the file, or the flag that set it."""
    from chainspec.cluster.config import StackConfig

    return StackConfig.from_dict(file_with_flags(args), where(args), flag_names(args))


def namespace(args: argparse.Namespace) -> str:
    return args.namespace or NAMESPACE


def print_members(members: list[dict[str, Any]], as_json: bool, target=None,
                  autoscale: dict[str, Any] | None = None) -> None:
    """The members as a table or JSON; `target` (a `stack.Target`) is the stack they
    belong to: the first line of the table, `address` and `namespace` in the JSON;
    `autoscale` (`stack.autoscale_state`): a line under it, `autoscale` in the JSON."""
    if as_json:
        where = {"address": target.address, "namespace": target.namespace} if target else {}
        more = {"autoscale": autoscale} if autoscale is not None else {}
        print(json.dumps({**where, **more, "members": jsonable(members)}, indent=2))
        return
    if target is not None:
        print(target)
    if autoscale is not None:
        print(autoscale_line(autoscale))
    cols = ("member_id", "role", "state", "endpoint", "load", "pid", "node")
    rows = [cols] + [tuple(str(m.get(c)) for c in cols) for m in members]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    print("  ".join(v.ljust(w) for v, w in zip(rows[0], widths, strict=True)).rstrip())
    for m, r in zip(members, rows[1:], strict=True):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
        for rank in m.get("ranks") or ():  # a TP group: one line per rank
            print(f"  rank {rank['rank']}: {rank['state']}, pid {rank['pid']}, "
                  f"node {rank['node']}")


def autoscale_line(state: dict[str, Any]) -> str:
    """`drafters: auto:1-4, desired 3; last: up 1 -> 3 (occupancy: ...)`."""
    policy, last = state.get("policy"), state.get("last_decision")
    spec = f"auto:{policy['min_drafters']}-{policy['max_drafters']}" if policy else "fixed"
    line = f"drafters: {spec}, desired {state.get('desired')}"
    if last:
        line += f"; last decision: {last['direction']} {last['before']} -> {last['after']} " \
                f"({last['reason']})"
    return line

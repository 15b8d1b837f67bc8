"""`chainspec up`: start a stack -- the controller, N verifiers and M drafters as Ray
actors -- on an embedded local Ray (default) or on the cluster at --address.

Without --detach it stays in the foreground until Ctrl-C (or SIGTERM, e.g. from
`chainspec down` in another shell) and then stops the stack. With --detach it returns
once every member serves: on a cluster the detached controller keeps the stack alive; an
embedded Ray is then hosted by a background `chainspec up` process (log and config in
the state directory) that `chainspec down` stops. A stack on an embedded Ray gets a
random service token unless --token-file/--token-env gives one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from chainspec.commands.hub_args import local_model
from chainspec.commands.server_args import jsonable
from chainspec.commands.signals import until_stopped
from chainspec.commands.stack_args import print_members, stack_config
from chainspec.commands.stack_flags import add_model_positional, add_stack_args
from chainspec.spine.sections import StackSection

if TYPE_CHECKING:  # NOTE: Ray loads in run, not to build the parser
    from chainspec.cluster.config import StackConfig


def add_parser(sub) -> list[str]:
    p = sub.add_parser("up", help="start drafters and verifiers as Ray actors",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_positional(p)
    add_stack_args(p, aliases={"grpc_host": ("--host",)})  # serve's --host is the HTTP one
    p.add_argument("--address", default=None,
                   help="join the Ray cluster at this address (default: embedded local Ray)")
    p.add_argument("--detach", action="store_true", help="return once the stack is ready")
    p.add_argument("--timeout", type=float,
                   default=StackSection.model_fields["start_timeout_s"].default,
                   help="seconds to wait for every member to serve")
    p.add_argument("--json", action="store_true", help="print the members as JSON")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the arguments, print the resolved config, start nothing")
    return ["up"]


def run(args: argparse.Namespace) -> int:
    from chainspec.cluster import stack
    from chainspec.cluster.plain_target import check_stack_model, serve_plainly

    config, warning = serve_plainly(local_model(stack_config(args)))  # a Hub id
    if warning:
        print(f"chainspec up: warning: {warning}", file=sys.stderr, flush=True)
    check_stack_model(config, must_exist=args.address is None)  # before Ray
    if args.dry_run:
        print(json.dumps({"command": "up", "address": args.address, "detach": args.detach,
                          "config": jsonable(config.to_dict())}, indent=2))
        return 0
    try:
        if args.detach and args.address is None:
            return _up_in_background(config, args.timeout, args.json)
        members = stack.up(config, args.address, args.timeout)
    except stack.StackError as e:
        print(f"chainspec up: {e}", file=sys.stderr)
        return 1
    print_members(members, args.json, stack.target_of(config.namespace))
    if args.detach:
        return 0
    print("stack up; Ctrl-C stops it", file=sys.stderr, flush=True)  # stdout: JSON
    return until_stopped(lambda _why: _down(config.namespace))


def _down(namespace: str) -> None:
    from chainspec.cluster import stack

    try:
        stack.down(namespace=namespace)
    except stack.StackNotFound:
        pass  # stopped from elsewhere
    print("stack stopped", file=sys.stderr, flush=True)


def _up_in_background(config: StackConfig, timeout_s: float, as_json: bool) -> int:
    """Run `chainspec up` (foreground) in its own session; return once it is ready."""
    from chainspec.cluster import stack

    stack.check_no_local_owner(config.namespace)
    base = stack.state_path(config.namespace)
    base.parent.mkdir(parents=True, exist_ok=True)
    cfg_path, log_path = base.with_suffix(".config.json"), base.with_suffix(".log")
    cfg_path.touch(mode=0o600)  # NOTE: may hold the shared token
    cfg_path.write_text(json.dumps(config.to_dict()))
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "chainspec.cli", "up", "--config", str(cfg_path),
             "--timeout", str(timeout_s)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    deadline = time.monotonic() + timeout_s + 60
    while time.monotonic() < deadline:
        state = stack.read_state(config.namespace)
        if state is not None and state.owner_pid == child.pid:
            print(f"stack up in the background (pid {child.pid}, log {log_path})",
                  file=sys.stderr)
            print_members(stack.status(namespace=config.namespace), as_json,
                          stack.target_of(config.namespace))
            return 0
        if child.poll() is not None:
            break
        time.sleep(0.5)
    if child.poll() is None:
        os.kill(child.pid, signal.SIGTERM)
    tail = log_path.read_text()[-3000:]
    print(f"chainspec up: the stack did not come up; log {log_path}:\n{tail}", file=sys.stderr)
    return 1

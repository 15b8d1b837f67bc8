"""Arguments shared by the stack commands (`up`, `status`, `scale`, `down`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from chainspec.cluster.config import NAMESPACE, StackConfig
from chainspec.commands.server_args import add_token_args, jsonable, read_token
from chainspec.engine.local import DTYPES, DrafterMode

# flag -> StackConfig field, for flags that override the --config file when given
_OVERRIDES = {"model": "model_dir", "k": "num_steps", "max_seqs": "max_seqs",
              "drafter_max_seqs": "drafter_max_seqs", "max_len": "max_len", "dtype": "dtype",
              "host": "host", "health_interval": "health_interval_s",
              "drain_timeout": "drain_timeout_s", "draft_deadline": "draft_deadline_s",
              "pipeline_groups": "pipeline_groups", "draft_ahead": "draft_ahead"}
_ROLE_OVERRIDES = {"drafters": ("drafter", "replicas"), "verifiers": ("verifier", "replicas"),
                   "drafter_gpus": ("drafter", "num_gpus"),
                   "verifier_gpus": ("verifier", "num_gpus"),
                   "drafter_mode": ("drafter", "mode")}


def add_connect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="Ray address of the stack's cluster (`auto`: the local Ray); "
                        "default: the namespace's state file, written by `up`/`serve`. "
                        "Without either the command refuses: it never guesses a stack")
    p.add_argument("--namespace", default=None, help=f"Ray namespace (default: {NAMESPACE})")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the arguments and print them; connect to nothing")


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="stack config file (YAML or JSON); flags override")
    p.add_argument("--model", help="model directory (default: the bundled demo model)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, help="K")
    p.add_argument("--no-chain", dest="chain", action="store_false", default=None)
    p.add_argument("--max-seqs", type=int, help="sequence slots per verifier")
    p.add_argument("--drafter-max-seqs", type=int, help="sequence slots per drafter")
    p.add_argument("--max-len", type=int, help="context length per slot")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--drafters", type=int, help="drafter actors")
    p.add_argument("--verifiers", type=int, help="verifier actors")
    p.add_argument("--drafter-gpus", type=float, help="GPUs per drafter (0: CPU)")
    p.add_argument("--verifier-gpus", type=float, help="GPUs per verifier (0: CPU)")
    p.add_argument("--host", help="gRPC bind address; 0.0.0.0 advertises the node's IP")
    p.add_argument("--health-interval", type=float, help="seconds between health pings")
    p.add_argument("--drain-timeout", type=float, help="longest drain of a member, seconds")
    p.add_argument("--draft-deadline", type=float, help="seconds a round waits for drafts")
    add_stack_mode_args(p)
    add_token_args(p)


def add_stack_mode_args(p: argparse.ArgumentParser) -> None:
    """Where drafting runs and how verifiers pipeline (`up` and `serve`)."""
    p.add_argument("--drafter-mode", choices=[m.value for m in DrafterMode],
                   help="remote (default): drafter actors over gRPC; local: each verifier "
                        "runs the MTP modules in its own process, no drafter actors")
    p.add_argument("--pipeline-groups", type=int,
                   help="verifier groups taking turns so drafts overlap verification "
                        "(default 1: off)")
    p.add_argument("--draft-ahead", action="store_true", default=None,
                   help="verifiers use drafters' look-ahead drafts on a hit (default off)")


def stack_config(args: argparse.Namespace) -> StackConfig:
    """The --config file (if any) with the given flags on top, validated."""
    data: dict[str, Any] = _read_config(args.config) if args.config else {}
    for flag, key in _OVERRIDES.items():
        if getattr(args, flag) is not None:
            data[key] = str(getattr(args, flag)) if flag == "model" else getattr(args, flag)
    if args.chain is not None:
        data["chain"] = args.chain
    for flag, (role, key) in _ROLE_OVERRIDES.items():
        if getattr(args, flag) is not None:
            data[role] = {**data.get(role, {}), key: getattr(args, flag)}
    if args.namespace:
        data["namespace"] = args.namespace
    token = read_token(args)
    if token:
        data["auth_token"] = token
    return StackConfig.from_dict(data)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not YAML or JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping at the top level")
    return data


def namespace(args: argparse.Namespace) -> str:
    return args.namespace or NAMESPACE


def print_members(members: list[dict[str, Any]], as_json: bool, target=None) -> None:
    """The members as a table or JSON; `target` (a `stack.Target`) is the stack they
    belong to: the first line of the table, `address` and `namespace` in the JSON."""
    if as_json:
        where = {"address": target.address, "namespace": target.namespace} if target else {}
        print(json.dumps({**where, "members": jsonable(members)}, indent=2))
        return
    if target is not None:
        print(target)
    cols = ("member_id", "role", "state", "endpoint", "load", "pid", "node")
    rows = [cols] + [tuple(str(m.get(c)) for c in cols) for m in members]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())

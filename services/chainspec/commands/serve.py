"""`chainspec serve`: the whole stack -- a Ray controller, verifiers and drafters, and the
OpenAI-compatible HTTP gateway -- in one command.

By default on an embedded local Ray with the bundled demo model, one verifier and one
drafter, the gateway on 127.0.0.1:8000. `--address` joins an existing Ray cluster,
`--model` serves your model directory, `--config FILE` reads a YAML file (schema in
docs/design.md, "Gateway and serve"); flags override the file. `chainspec status`,
`scale` and `down` work against it from another shell (same --namespace). Ctrl-C, SIGTERM
or `chainspec down` stops the gateway and then the stack.

`serve` owns what it started: the stack (and an embedded Ray) stop when it stops; it
refuses to start where a stack already runs in the namespace. On an embedded Ray the
services get a random token, so no other local process can call them (`--token-file`
sets your own).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chainspec.commands.help_format import DefaultsHelpFormatter
from chainspec.commands.hub_args import local_model
from chainspec.commands.signals import until_stopped
from chainspec.commands.stack_flags import (
    GATEWAY_FLAGS,
    add_flags,
    add_model_positional,
    add_stack_args,
    file_with_flags,
    flag_names,
    stack_overrides,
    where,
)

if TYPE_CHECKING:
    from chainspec.serving.config import ServeConfig

API_KEY_ENV = "CHAINSPEC_API_KEY"


def add_parser(sub) -> list[str]:
    p = sub.add_parser("serve", help="the whole stack with the OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=DefaultsHelpFormatter)
    add_model_positional(p)
    add_stack_args(p)
    p.add_argument("--address", help="join the Ray cluster at this address "
                                     "(default: an embedded local Ray)")
    add_gateway_flags(p)
    p.add_argument("--api-key-file", type=Path,
                   help=f"require this API key (default: ${API_KEY_ENV} when set)")
    p.add_argument("--timeout", type=float, help="seconds to wait for the stack to be ready "
                                                  "(the file's start_timeout_s; default 300)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config, print it resolved (secrets masked), start nothing")
    return ["serve"]


def add_gateway_flags(p: argparse.ArgumentParser) -> None:
    """The gateway's rows (`commands/stack_flags.py` GATEWAY_FLAGS: --host, --port,
    --served-model-name, --chat-template, ...), for every command with a gateway; unset
    (None) leaves a config file's value, else the spine's default."""
    add_flags(p, rows=GATEWAY_FLAGS)


def resolve(args: argparse.Namespace) -> ServeConfig:
    """The config file with the flags on top, validated (ValueError names the problem)."""
    from chainspec.serving.config import ServeConfig

    return ServeConfig.from_dict(file_with_flags(args, _serve_overrides(args)), where(args),
                                 flag_names(args))


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """What `serve` adds to the stack flags: where Ray is, the wait, the gateway."""
    out: dict[str, Any] = stack_overrides(args, GATEWAY_FLAGS)
    if args.address is not None:
        out["address"] = args.address
    if args.timeout is not None:
        out["start_timeout_s"] = args.timeout
    api_key = read_api_key(args)
    if api_key:
        out.setdefault("gateway", {})["api_key"] = api_key
    return out


def read_api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        key = args.api_key_file.read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get(API_KEY_ENV, "").strip() or None


def run(args: argparse.Namespace) -> int:
    from chainspec.cluster.plain_target import check_stack_model, serve_plainly

    config = resolve(args)
    config = dataclasses.replace(config, stack=local_model(config.stack))  # a Hub id
    plain, warning = serve_plainly(config.stack)
    if warning:  # a model without MTP modules: no drafters
        config = dataclasses.replace(config, stack=plain)
        print(f"chainspec serve: warning: {warning}", file=sys.stderr, flush=True)
    check_stack_model(config.stack, must_exist=config.address is None)  # before Ray
    if config.gateway.chat_template:  # a missing file or broken template: before Ray too
        from chainspec.gateway.chat_template import ChatTemplate
        ChatTemplate.from_model_dir(None, config.gateway.chat_template)
    from chainspec.gateway.generation_config import sampling_defaults

    model_dir = config.stack.model_dir if Path(config.stack.model_dir).is_dir() else None
    sampling_defaults(config.gateway.generation_config, model_dir)  # a bad one: before Ray
    if args.dry_run:
        print(json.dumps({"command": "serve", "config": config.describe()}, indent=2))
        return 0
    from chainspec.serving.ports import check_ports

    check_ports(config, embedded=config.address is None)  # before Ray: a busy port is exit 2
    from chainspec.cluster import stack
    from chainspec.serving.progress import Progress
    from chainspec.serving.runner import ServingStack

    progress = Progress()
    try:
        serving = ServingStack.start(config, progress)
    except (stack.StackError, TimeoutError, RuntimeError) as e:
        print(f"chainspec serve: {e}", file=sys.stderr)
        return 1
    return _serve_until_stopped(serving, progress)


def _serve_until_stopped(serving, progress) -> int:
    """Until SIGINT/SIGTERM or the stack vanishing; then the gateway and the stack stop
    (whatever happens, once started)."""
    def stop(why: str) -> None:
        progress.step(f"{why}; stopping the gateway and the stack")
        serving.stop()
        progress.step("stopped")
    try:
        print(usage_text(serving), flush=True)
    except BaseException:
        serving.stop()
        raise
    return until_stopped(stop, serving.lost)


def usage_text(serving) -> str:
    c, url = serving.config, serving.url
    ns = "" if c.stack.namespace == "chainspec" else f" --namespace {c.stack.namespace}"
    return "\n".join([
        f"\nchainspec is serving {serving.model_name()!r} at {url} "
        f"(OpenAI-compatible: base_url {url}/v1)",
        f"  stack:  {serving.target}",
        f"  try:    {serving.curl_example()}",
        f"  health: curl {url}/health",
        f"  from another shell: chainspec status{ns} | chainspec scale drafters 2{ns} "
        f"| chainspec down{ns}",
        "  Ctrl-C stops it.\n"])

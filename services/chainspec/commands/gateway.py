"""`chainspec gateway`: the OpenAI-compatible HTTP gateway alone, routed to the verifiers
given with --verifier (repeat), or to the ready verifiers of the stack at --address
(its controller's membership).

For plain deployments (the gateway as its own pod) and debugging. Prints
`gateway serving <url>` once it listens; SIGTERM or SIGINT stops it. With --address it
joins the running stack (a restarted gateway joins again; stopping it never stops the
stack) and uses the stack's service token unless one is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from chainspec.commands.serve import add_gateway_flags, read_api_key
from chainspec.commands.server_args import add_token_args, read_token
from chainspec.commands.signals import until_stopped
from chainspec.commands.stack_flags import (
    GATEWAY_FLAGS,
    SECRET,
    add_refused_flags,
    flag_names,
    stack_overrides,
)
from chainspec.spine.sections import StackSection

if TYPE_CHECKING:
    from chainspec.gateway.config import GatewayConfig

NAMESPACE = StackSection.model_fields["namespace"].default


def add_parser(sub) -> list[str]:
    p = sub.add_parser("gateway", help="run the HTTP gateway alone",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--verifier", action="append", metavar="HOST:PORT",
                        help="a verifier endpoint (repeat for several)")
    source.add_argument("--address", help="Ray address of a running stack")
    p.add_argument("--namespace", default=NAMESPACE, help="Ray namespace of the stack")
    p.add_argument("--model", type=Path, help="model directory, for its chat template")
    add_gateway_flags(p)  # --host, --port, --served-model-name, --chat-template, ...
    add_refused_flags(p, SECRET)  # vLLM's --api-key: refused without echoing the key
    p.add_argument("--api-key-file", type=Path, help="require this API key "
                                                     "(default: $CHAINSPEC_API_KEY when set)")
    add_token_args(p)
    p.add_argument("--tls-ca", type=Path, help="CA that verifier certificates must chain to")
    p.add_argument("--tls-cert", type=Path, help="client certificate for mTLS (PEM)")
    p.add_argument("--tls-key", type=Path, help="client private key for mTLS (PEM)")
    p.add_argument("--tls-server-name", help="name to check verifier certificates against "
                                             "(default: the host dialled)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the arguments, print them resolved, start nothing")
    return ["gateway"]


def resolve(args: argparse.Namespace) -> GatewayConfig:
    """The gateway flags over the spine's defaults (ValueError names the flag)."""
    from chainspec.gateway.config import GatewayConfig

    given = stack_overrides(args, GATEWAY_FLAGS).get("gateway", {})
    api_key = read_api_key(args)
    if api_key:
        given["api_key"] = api_key
    named = {k.removeprefix("gateway."): v for k, v in flag_names(args).items()}
    return GatewayConfig.from_dict(given, "flags", named)


def run(args: argparse.Namespace) -> int:
    from chainspec.gateway.membership import StaticVerifiers
    from chainspec.serving.config import mask_secrets

    config = resolve(args)
    source = StaticVerifiers(args.verifier) if args.verifier else None
    if args.dry_run:
        print(json.dumps({"command": "gateway", "gateway": mask_secrets(config.to_dict()),
                          "verifiers": args.verifier, "address": args.address,
                          "namespace": args.namespace,
                          "tls": {k: str(v) if v else None for k, v in (
                              ("ca", args.tls_ca), ("cert", args.tls_cert),
                              ("key", args.tls_key), ("server_name", args.tls_server_name))}},
                          indent=2))
        return 0
    from chainspec.gateway.chat_template import ChatTemplate
    from chainspec.gateway.server import GatewayServer
    from chainspec.rpc.channel import ClientOptions
    from chainspec.serving.runner import LoopThread

    chat = ChatTemplate.from_model_dir(args.model, config.chat_template)  # NOTE: fails first
    from chainspec.gateway.generation_config import sampling_defaults

    config = dataclasses.replace(config, sampling_defaults=sampling_defaults(
        config.generation_config, args.model))
    lost = threading.Event()
    token = read_token(args)
    if source is None:
        try:
            source, token = _join_stack(args, token, lost.set)
        except Exception as e:  # StackError, or the stack vanished while we asked
            print(f"chainspec gateway: {e}", file=sys.stderr)
            return 1
    loop = LoopThread()
    server = loop.run(GatewayServer.start(config, source, chat,
                                          ClientOptions(auth_token=token,
                                                        tls_ca=args.tls_ca,
                                                        tls_cert=args.tls_cert,
                                                        tls_key=args.tls_key,
                                                        tls_server_name=args.tls_server_name)))
    print(f"gateway serving {server.url}", flush=True)

    def stop(_why: str) -> None:
        loop.run(server.stop(), timeout=30)
        loop.close()
    return until_stopped(stop, lost)


def _join_stack(args: argparse.Namespace, token: str | None, on_lost):
    """The running stack's membership (this gateway joins it; stopping the gateway
    leaves it, never stops the stack) and the service token: the given one, else the
    stack's own (a local stack's random default)."""
    from chainspec.cluster import stack
    from chainspec.gateway.membership import ControllerVerifiers

    controller = stack.connect(args.address, args.namespace)
    if token is None:
        token = stack.config(args.address, args.namespace).auth_token
    print(f"gateway joining {stack.target_of(args.namespace)}", file=sys.stderr, flush=True)
    # NOTE: with an explicit --address only: a state file's Ray may be a different one now
    rejoin = (lambda: _rejoin(args)) if args.address else None
    return ControllerVerifiers(controller, on_lost, rejoin), token


def _rejoin(args: argparse.Namespace):
    """The controller through a new Ray session, after the old one ended."""
    import ray

    from chainspec.cluster import stack

    ray.shutdown()  # NOTE: the ended session's context, else ray.init refuses
    return stack.connect(args.address, args.namespace)

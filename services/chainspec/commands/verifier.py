"""`chainspec verifier`: one Verifier gRPC service, standalone (no Ray), routed to the
drafters given with --drafter (none: plain decoding).

For debugging and for plain Kubernetes pods. Prints `verifier serving <host:port>` once
the model is loaded and warmed up; on SIGTERM or SIGINT it drains (health NOT_SERVING,
new requests UNAVAILABLE, up to --drain-grace seconds for requests in flight) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chainspec.commands.model_args import (
    VERIFIER_ALIASES,
    VERIFIER_KEYS,
    add_model_args,
    local_options,
)
from chainspec.commands.server_args import add_server_args, jsonable, server_options
from chainspec.commands.signals import StopSignal, serve_until_signal
from chainspec.commands.stack_flags import flags_config
from chainspec.engine.options import DrafterMode

if TYPE_CHECKING:  # NOTE: torch and grpc load in resolve/run, not to build the parser
    from chainspec.rpc.channel import ClientOptions
    from chainspec.rpc.server import ServerOptions
    from chainspec.rpc.verifier_service import VerifierOptions


@dataclass(frozen=True)
class VerifierCommand:
    """Everything `chainspec verifier` resolved from its arguments."""

    verifier: VerifierOptions
    server: ServerOptions
    client: ClientOptions
    drafters: tuple[str, ...]

    def describe(self) -> dict:
        return jsonable({"verifier": asdict(self.verifier), "server": asdict(self.server),
                         "client": asdict(self.client), "drafters": list(self.drafters)})


def add_parser(sub) -> list[str]:
    p = sub.add_parser("verifier", help="run one verifier gRPC service (no Ray)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, VERIFIER_KEYS, VERIFIER_ALIASES)
    p.add_argument("--drafter", action="append", default=[], metavar="HOST:PORT",
                   help="a drafter endpoint (repeat for several; --drafter-mode remote)")
    p.add_argument("--model-name", default="",
                   help="name reported by Info (default: the model directory's name)")
    p.add_argument("--default-max-tokens", type=int,
                   help="max_tokens of a request that sets none (default: the verifier's, "
                        "256)")
    add_server_args(p)
    p.add_argument("--drafter-tls-ca", type=Path, help="CA that signed the drafters' certificates")
    p.add_argument("--drafter-tls-cert", type=Path, help="client certificate for drafters (mTLS)")
    p.add_argument("--drafter-tls-key", type=Path, help="client key for drafters (mTLS)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the arguments, print the resolved config, load nothing")
    return ["verifier"]


def resolve(args: argparse.Namespace) -> VerifierCommand:
    """Validate the arguments into config objects (ValueError names the problem)."""
    from chainspec.rpc.channel import ClientOptions
    from chainspec.rpc.verifier_service import VerifierOptions

    for ep in args.drafter:
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--drafter {ep!r}: expected HOST:PORT")
    config = flags_config(args)
    if args.drafter and config.drafter.mode is DrafterMode.LOCAL:
        raise ValueError("--drafter-mode local drafts in this process: it takes no --drafter")
    given = {} if args.default_max_tokens is None else \
        {"default_max_tokens": args.default_max_tokens}
    verifier = VerifierOptions.of_stack(config, model=local_options(args, "verifier"),
                                        model_name=args.model_name, **given)
    server = server_options(args, config)
    client = ClientOptions(tls_ca=args.drafter_tls_ca, tls_cert=args.drafter_tls_cert,
                           tls_key=args.drafter_tls_key, auth_token=server.auth_token,
                           max_message_bytes=server.max_message_bytes)
    return VerifierCommand(verifier, server, client, tuple(args.drafter))


def run(args: argparse.Namespace) -> int:
    cmd = resolve(args)
    if args.dry_run:
        print(json.dumps(cmd.describe(), indent=2))
        return 0
    return asyncio.run(_serve(cmd))


async def _serve(cmd: VerifierCommand) -> int:
    from chainspec.metrics.verifier import VerifierMetrics
    from chainspec.rpc.verifier_service import serve_verifier

    metrics = VerifierMetrics(cmd.verifier.name, cmd.verifier.model.num_steps) \
        if cmd.server.metrics_port is not None else None
    stop = StopSignal()
    verifier = await serve_verifier(cmd.verifier, cmd.server, cmd.drafters, cmd.client, metrics,
                                    on_failure=stop.fail)
    print(f"verifier serving {verifier.address} (drafters: {len(verifier.drafts.loads())})",
          flush=True)
    if metrics is not None:
        print(f"verifier metrics {verifier.metrics_url()}", flush=True)
    return await serve_until_signal("verifier", verifier.drain, stop)

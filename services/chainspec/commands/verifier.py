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

from chainspec.commands.model_args import add_model_args, local_options
from chainspec.commands.server_args import (
    add_server_args,
    jsonable,
    serve_until_signal,
    server_options,
)
from chainspec.engine.local import DrafterMode
from chainspec.metrics.verifier import VerifierMetrics
from chainspec.rpc.channel import ClientOptions
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier


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
    add_model_args(p)
    p.add_argument("--drafter", action="append", default=[], metavar="HOST:PORT",
                   help="a drafter endpoint (repeat for several)")
    p.add_argument("--model-name", default="",
                   help="name reported by Info (default: the model directory's name)")
    p.add_argument("--max-waiting", type=int, default=VerifierOptions.max_waiting,
                   help="queued requests beyond the running slots (then RESOURCE_EXHAUSTED)")
    p.add_argument("--default-max-tokens", type=int,
                   default=VerifierOptions.default_max_tokens)
    p.add_argument("--draft-deadline", type=float, default=VerifierOptions.draft_deadline_s,
                   help="seconds a round waits for drafts before decoding plainly")
    p.add_argument("--drafter-mode", choices=[m.value for m in DrafterMode],
                   default=VerifierOptions.drafter.value,
                   help="remote: draft through --drafter services; local: run the MTP "
                        "modules in this process (no drafter service, no wire)")
    p.add_argument("--pipeline-groups", type=int, default=VerifierOptions.groups,
                   help="groups of running sequences taking turns, so one group's drafts "
                        "are computed while another is verified (default 1: off)")
    p.add_argument("--draft-ahead", action="store_true",
                   help="ask drafters for look-ahead drafts (the likely verdict of the "
                        "round being verified) and verify them at once on a hit")
    add_server_args(p)
    p.add_argument("--drafter-tls-ca", type=Path, help="CA that signed the drafters' certificates")
    p.add_argument("--drafter-tls-cert", type=Path, help="client certificate for drafters (mTLS)")
    p.add_argument("--drafter-tls-key", type=Path, help="client key for drafters (mTLS)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the arguments, print the resolved config, load nothing")
    return ["verifier"]


def resolve(args: argparse.Namespace) -> VerifierCommand:
    """Validate the arguments into config objects (ValueError names the problem)."""
    for ep in args.drafter:
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--drafter {ep!r}: expected HOST:PORT")
    if args.drafter and args.drafter_mode == DrafterMode.LOCAL:
        raise ValueError("--drafter-mode local drafts in this process: it takes no --drafter")
    verifier = VerifierOptions(local_options(args), args.model_name, args.max_waiting,
                               args.default_max_tokens, args.draft_deadline,
                               drafter=DrafterMode(args.drafter_mode),
                               groups=args.pipeline_groups, draft_ahead=args.draft_ahead)
    server = server_options(args)
    client = ClientOptions(tls_ca=args.drafter_tls_ca, tls_cert=args.drafter_tls_cert,
                           tls_key=args.drafter_tls_key, auth_token=server.auth_token,
                           max_message_bytes=args.max_message_bytes)
    return VerifierCommand(verifier, server, client, tuple(args.drafter))


def run(args: argparse.Namespace) -> int:
    cmd = resolve(args)
    if args.dry_run:
        print(json.dumps(cmd.describe(), indent=2))
        return 0
    return asyncio.run(_serve(cmd))


async def _serve(cmd: VerifierCommand) -> int:
    metrics = VerifierMetrics(cmd.verifier.name, cmd.verifier.model.num_steps) \
        if cmd.server.metrics_port is not None else None
    failed: asyncio.Future = asyncio.get_running_loop().create_future()

    def engine_failed(reason: str) -> None:
        if not failed.done():
            failed.set_result(reason)
    verifier = await serve_verifier(cmd.verifier, cmd.server, cmd.drafters, cmd.client, metrics,
                                    on_failure=engine_failed)
    print(f"verifier serving {verifier.address} (drafters: {len(verifier.drafts.loads())})",
          flush=True)
    if metrics is not None:
        print(f"verifier metrics {verifier.metrics_url()}", flush=True)
    return await serve_until_signal("verifier", verifier.drain, failed)

"""`chainspec health`: one standard gRPC health check (grpc.health.v1 Check) of a
drafter or verifier at --address, over the same TLS/mTLS and token settings its clients
use. Exits 0 when the service reports SERVING, 1 otherwise (NOT_SERVING, UNKNOWN, an
unknown service name, unreachable, a refused handshake, no answer within --timeout),
with the reason on one stderr line.

For Kubernetes exec probes, which can present client certificates where kubelet's own
gRPC probe cannot. It imports only gRPC, so `python -m chainspec.commands.health ARGS`
(the same parser, without loading every other command's torch imports) starts in a
fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chainspec.commands.server_args import add_token_args, jsonable, read_token

if TYPE_CHECKING:  # NOTE: grpc loads in run, not to build the parser
    from chainspec.rpc.channel import ClientOptions

DEFAULT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class HealthCommand:
    """Everything `chainspec health` resolved from its arguments."""

    address: str
    service: str
    timeout_s: float
    client: ClientOptions

    def describe(self) -> dict:
        return jsonable({"address": self.address, "service": self.service,
                         "timeout_s": self.timeout_s, "client": asdict(self.client)})


def add_parser(sub) -> list[str]:
    p = sub.add_parser("health", help="check a drafter's or verifier's gRPC health",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, metavar="HOST:PORT", help="service to check")
    p.add_argument("--service", default="",
                   help='service name to check ("": the server as a whole)')
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds to wait for the answer, connecting included")
    p.add_argument("--tls-ca", type=Path, help="CA the server certificate must chain to")
    p.add_argument("--tls-cert", type=Path, help="client certificate for mTLS (PEM)")
    p.add_argument("--tls-key", type=Path, help="client private key for mTLS (PEM)")
    p.add_argument("--tls-server-name",
                   help="name to check the server certificate against (default: the host)")
    add_token_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the arguments, print them resolved, check nothing")
    return ["health"]


def resolve(args: argparse.Namespace) -> HealthCommand:
    """Validate the arguments (ValueError names the problem); reads no certificate."""
    host, _, port = args.address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address {args.address!r}: expected HOST:PORT")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    if args.tls_server_name and args.tls_ca is None:
        raise ValueError("--tls-server-name needs TLS: set --tls-ca")
    from chainspec.rpc.channel import ClientOptions

    client = ClientOptions(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                           tls_server_name=args.tls_server_name, auth_token=read_token(args))
    return HealthCommand(args.address, args.service, args.timeout, client)


def check(cmd: HealthCommand) -> str | None:
    """None when the service is SERVING, else why not (one line)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from chainspec.rpc.channel import make_channel

    channel = make_channel(cmd.address, cmd.client)
    try:
        with _quiet_grpc_core():
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=cmd.service), timeout=cmd.timeout_s)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return f"unknown service {cmd.service!r}"
        details = " ".join((e.details() or "").split())
        return f"unreachable: {e.code().name}: {details}"
    finally:
        channel.close()
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


@contextlib.contextmanager
def _quiet_grpc_core():
    """NOTE: gRPC core logs handshake failures straight to fd 2 (GRPC_VERBOSITY is read
    only when grpc is imported); a probe's output should be its one-line reason, and the
    RPC error already carries the TLS error, so fd 2 is /dev/null during the call."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def run(args: argparse.Namespace) -> int:
    cmd = resolve(args)
    if args.dry_run:
        print(json.dumps(cmd.describe(), indent=2))
        return 0
    reason = check(cmd)
    if reason is None:
        return 0
    what = f"{cmd.address} service {cmd.service!r}" if cmd.service else cmd.address
    print(f"chainspec health: {what}: {reason}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """`python -m chainspec.commands.health ARGS`: `chainspec health ARGS` with only this
    command's imports (a probe pays no torch import)."""
    parser = argparse.ArgumentParser(prog="chainspec")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["health", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except (ValueError, OSError) as e:
        print(f"chainspec health: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Server arguments of the service commands (`drafter`, `verifier`) beyond the stack
flags they share with `serve`/`up` (their gRPC host among them: `commands/model_args.py`),
and the token flags every command that calls or serves the services takes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chainspec.cluster.config import StackConfig
    from chainspec.rpc.server import ServerOptions

TOKEN_ENV = "CHAINSPEC_AUTH_TOKEN"  # read when set and neither token flag is given


def add_token_args(p: argparse.ArgumentParser) -> None:
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token-file", type=Path, help="file holding the shared token "
                                                       "(default: none, see --token-env)")
    token.add_argument("--token-env", metavar="NAME",
                       help=f"environment variable holding the shared token "
                            f"(default: {TOKEN_ENV} when set)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    # NOTE: None -> ServerOptions' defaults (read there, so no parser imports grpc)
    p.add_argument("--port", type=int, help="0: any free port (default: 0)")
    p.add_argument("--max-message-bytes", type=int,
                   help="largest gRPC message (default: the server's, 64 MiB)")
    p.add_argument("--drain-grace", type=float,
                   help="seconds calls in flight get to finish when draining (default: "
                        "the server's, 10 s)")
    p.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    p.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", type=Path,
                   help="CA for client certificates: set to require them (mTLS)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus metrics port on --host (0: any free port; -1: off)")
    add_token_args(p)


def server_options(args: argparse.Namespace, config: StackConfig) -> ServerOptions:
    """This service's server: host and token as resolved into `config` (the stack flags'
    `flags_config`), the rest from the flags above."""
    from chainspec.rpc.server import ServerOptions

    given = {k: v for k, v in (("port", args.port), ("max_message_bytes",
                                                      args.max_message_bytes),
                               ("drain_grace_s", args.drain_grace)) if v is not None}
    return ServerOptions(host=config.host, tls_cert=args.tls_cert, tls_key=args.tls_key,
                         tls_client_ca=args.tls_client_ca, auth_token=config.auth_token,
                         metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                         **given)


def read_token(args: argparse.Namespace) -> str | None:
    """The shared token from --token-file, --token-env or $CHAINSPEC_AUTH_TOKEN; never argv."""
    if args.token_file is not None:
        token = args.token_file.read_text().strip()
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty")
        return token
    if args.token_env is not None:
        token = os.environ.get(args.token_env, "").strip()
        if not token:
            raise ValueError(f"--token-env: ${args.token_env} is unset or empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


def jsonable(value):
    """Dataclass dicts with Paths as strings and any token masked."""
    if isinstance(value, dict):
        return {k: ("<set>" if k == "auth_token" and v else jsonable(v)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value

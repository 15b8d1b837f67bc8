"""`chainspec drafter`: one Drafter gRPC service, standalone (no Ray).

For debugging and for plain Kubernetes pods. Prints `drafter serving <host:port>` once
the model is loaded and warmed up; on SIGTERM or SIGINT it drains (health NOT_SERVING,
new streams refused, up to --drain-grace seconds for open streams) and exits 0.
The shared token comes from a file or an environment variable, never from argv.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chainspec.commands.model_args import (
    DRAFTER_ALIASES,
    DRAFTER_KEYS,
    add_model_args,
    local_options,
)
from chainspec.commands.server_args import add_server_args, jsonable, server_options
from chainspec.commands.signals import serve_until_signal
from chainspec.commands.stack_flags import flags_config
from chainspec.models.hub import served_name

if TYPE_CHECKING:  # NOTE: torch and grpc load in resolve/run, not to build the parser
    from chainspec.engine.drafter import DrafterConfig
    from chainspec.engine.options import LocalOptions
    from chainspec.metrics.drafter import DrafterMetrics
    from chainspec.rpc.server import ServerOptions


@dataclass(frozen=True)
class DrafterCommand:
    """Everything `chainspec drafter` resolved from its arguments."""

    local: LocalOptions
    drafter: DrafterConfig
    server: ServerOptions
    model_name: str

    def describe(self) -> dict:
        """The resolved config as JSON-able values; the token is never printed."""
        return jsonable({"model_name": self.model_name, "model": asdict(self.local),
                         "drafter": asdict(self.drafter), "server": asdict(self.server)})


def add_parser(sub) -> list[str]:
    p = sub.add_parser("drafter", help="run one drafter gRPC service (no Ray)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, DRAFTER_KEYS, DRAFTER_ALIASES)
    p.add_argument("--model-name", default=None,
                   help="name reported by Info (default: the model directory's name)")
    add_server_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="validate the arguments, print the resolved config, load nothing")
    return ["drafter"]


def resolve(args: argparse.Namespace) -> DrafterCommand:
    """Validate the arguments into config objects (ValueError names the problem)."""
    from chainspec.engine.factory import drafter_config

    config = flags_config(args)
    # NOTE: in a stack the KV flags size the verifiers' pools; alone, they size this one
    local = dataclasses.replace(local_options(args, "drafter"),
                                kv_cache_memory=config.kv_cache_memory,
                                kv_cache_fraction=config.kv_cache_fraction,
                                gpu_memory_utilization=config.gpu_memory_utilization)
    if local.tensor_parallel_size > 1:  # -tp: refused before anything loads
        from chainspec.engine.tp_launch import check_model
        check_model(local.model_dir, local.tensor_parallel_size, draft=True)
    name = args.model_name or served_name(Path(local.model_dir).resolve())
    return DrafterCommand(local, drafter_config(local), server_options(args, config), name)


def run(args: argparse.Namespace) -> int:
    cmd = resolve(args)
    if args.dry_run:
        print(json.dumps(cmd.describe(), indent=2))
        return 0
    from chainspec.engine.factory import load_drafter
    from chainspec.metrics.drafter import DrafterMetrics

    metrics = DrafterMetrics(cmd.model_name, cmd.drafter.num_steps) \
        if cmd.server.metrics_port is not None else None
    engine = load_drafter(cmd.local, observer=metrics)
    return asyncio.run(_serve(engine, cmd, metrics))


async def _serve(engine, cmd: DrafterCommand, metrics: DrafterMetrics | None) -> int:
    from chainspec.rpc.drafter_service import serve_drafter

    running = await serve_drafter(engine, cmd.server, cmd.model_name, metrics=metrics)
    print(f"drafter serving {running.address}", flush=True)
    if metrics is not None:
        print(f"drafter metrics {running.metrics_url()}", flush=True)
    return await serve_until_signal("drafter", running.drain)

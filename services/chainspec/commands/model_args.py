"""Arguments of commands that run an engine in this process (`generate`, `bench`,
`drafter`, `verifier`): their rows of the stack-flag table (`commands/stack_flags.py`),
resolved through a `StackConfig` as `serve` and `up` resolve them, plus what only a
process has (`--device`, `--threads`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from chainspec.commands.hub_args import local_model
from chainspec.commands.stack_flags import add_flags, flags_config

if TYPE_CHECKING:
    from chainspec.engine.options import LocalOptions

# the stack flags of one engine (spine keys); a service command adds its own
ENGINE_KEYS = ("model", "revision", "download_dir", "num_speculative_tokens", "chain",
               "speculative_config",
               "max_num_seqs", "max_model_len", "dtype", "kv_cache_memory_bytes",
               "kv_cache_fraction", "gpu_memory_utilization", "block_size", "draft_top_k",
               "enforce_eager", "enable_prefix_caching", "state_snapshots", "seed")
TP_KEYS = (*ENGINE_KEYS, "verifier.tensor_parallel_size", "speculative_depth")  # generate, bench
DRAFTER_KEYS = (*(k for k in ENGINE_KEYS if k not in ("max_num_seqs", "state_snapshots")),
                "drafter_max_num_seqs",
                "grpc_host", "drafter.tensor_parallel_size")
VERIFIER_KEYS = (*ENGINE_KEYS, "grpc_host", "max_waiting", "draft_deadline_s",
                 "pipeline_groups", "draft_ahead", "scheduling_policy", "drafter.mode",
                 "speculative_depth")
# names the service commands had before the table (kept working): a lone drafter's
# --max-seqs/--max-num-seqs is its own slots (--drafter-max-num-seqs of a stack), --host
# the gRPC address; -tp its own ranks (vLLM's flag; --drafter-tensor-parallel-size of a
# stack)
DRAFTER_ALIASES = {"drafter_max_num_seqs": ("--max-num-seqs", "--max-seqs"),
                   "grpc_host": ("--host",),
                   "drafter.tensor_parallel_size": ("-tp", "--tensor-parallel-size")}
VERIFIER_ALIASES = {"grpc_host": ("--host",)}


def add_model_args(p: argparse.ArgumentParser, keys: Sequence[str] = ENGINE_KEYS,
                   aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    add_flags(p, keys, aliases)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a CPU, models of the demo's "
                        "size run fastest single-threaded; 0 keeps torch's default)")


def local_options(args: argparse.Namespace, role: str = "verifier") -> LocalOptions:
    """The engine options of the `role` engine this command runs, on --device (its
    dtype resolved for that device: `auto` is the checkpoint's on a GPU)."""
    if getattr(args, "threads", 0) and not getattr(args, "dry_run", False):
        import torch

        torch.set_num_threads(args.threads)
    config = local_model(flags_config(args))  # a Hub id: its local snapshot
    return dataclasses.replace(config.local_options(role), device=args.device,
                               dtype=config.dtype)

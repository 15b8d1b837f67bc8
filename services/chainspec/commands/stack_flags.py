"""The stack flags: one table, one way to add them, one strict config-file reader, one way
to lay the flags over the file.

A new stack flag is one `StackFlag` row in `STACK_FLAGS` (the `StackConfig` field it
sets, its names, its argparse options); `serve` and `up` then take it, and
`tests/unit/test_stack_flags.py` fails until it has an example value for it. The commands
that run one engine or service in their own process (`drafter`, `verifier`, `generate`,
`bench`) take the rows that concern them (`add_flags` with their keys; their lists are in
`commands/model_args.py`) and resolve them through the same `StackConfig`
(`flags_config`), so a flag means the same, with the same default, in every command.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chainspec.cluster.autoscale import AutoscalePolicy
from chainspec.cluster.config import ROLES, DrafterRoleConfig, RoleConfig, StackConfig
from chainspec.commands.server_args import add_token_args, read_token
from chainspec.engine.admission import SchedulingPolicy
from chainspec.engine.options import DTYPES, SPECULATIVE_DEPTHS, DrafterMode


@dataclass(frozen=True)
class StackFlag:
    key: str  # StackConfig field; "role.field" for a role section (drafter/verifier)
    names: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)  # add_argument keywords

    @property
    def dest(self) -> str:
        # NOTE: a prefix, so that no stack flag collides with a command's own (serve --host)
        return "stack_" + self.key.replace(".", "_")


def drafter_count(text: str) -> int | tuple[int, int]:
    """`--drafters`: a count, or `auto:MIN-MAX` as (min, max)."""
    if text.strip().startswith("auto"):
        try:
            policy = AutoscalePolicy.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return policy.min_drafters, policy.max_drafters
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a drafter count or auto:MIN-MAX, "
                                         f"got {text!r}") from None


STACK_FLAGS = (
    StackFlag("model_dir", ("--model",), {"help": "model directory (default: the bundled "
                                                   "demo model)"}),
    StackFlag("num_steps", ("-k", "--num-speculative-tokens"), {"type": int, "metavar": "K",
                                                         "help": "draft tokens per round"}),
    StackFlag("chain", ("--no-chain",), {"action": "store_false", "help": "every MTP step "
                                         "reads the target hidden state (non-chain mode)"}),
    StackFlag("max_seqs", ("--max-seqs",), {"type": int, "help": "sequence slots per verifier"}),
    StackFlag("drafter_max_seqs", ("--drafter-max-seqs",),
              {"type": int, "help": "sequence slots per drafter"}),
    StackFlag("max_len", ("--max-len",), {"type": int, "help": "context length per slot"}),
    StackFlag("dtype", ("--dtype",), {"choices": sorted(DTYPES)}),
    StackFlag("kv_cache_memory", ("--kv-cache-memory",),
              {"type": int, "metavar": "BYTES", "help": "each verifier's paged KV cache, bytes "
                                                  "(default: what its slots need)"}),
    StackFlag("kv_cache_fraction", ("--kv-cache-fraction",),
              {"type": float, "metavar": "F",
               "help": "paged KV cache as a share of free device memory (CUDA; "
                       "default: off)"}),
    StackFlag("kv_block_size", ("--kv-block-size",),
              {"type": int, "help": "positions per KV block (default 16)"}),
    StackFlag("draft_top_k", ("--draft-top-k",),
              {"type": int, "help": "support of sampled draft distributions (default 8)"}),
    StackFlag("use_graphs", ("--eager",),
              {"action": "store_false", "help": "no CUDA graphs (default: graphs on a GPU)"}),
    StackFlag("host", ("--grpc-host",),
              {"help": "gRPC bind address of the services; 0.0.0.0 advertises the node's IP"}),
    StackFlag("namespace", ("--namespace",), {"help": "Ray namespace of the stack "
                                                      "(default chainspec)"}),
    StackFlag("health_interval_s", ("--health-interval",),
              {"type": float, "help": "seconds between health pings"}),
    StackFlag("drain_timeout_s", ("--drain-timeout",),
              {"type": float, "help": "longest drain of a member, seconds"}),
    StackFlag("draft_deadline_s", ("--draft-deadline",),
              {"type": float, "help": "seconds a round waits for drafts"}),
    StackFlag("max_waiting", ("--max-waiting",),
              {"type": int, "help": "queued requests per verifier beyond its running "
                                    "slots (then RESOURCE_EXHAUSTED)"}),
    StackFlag("pipeline_groups", ("--pipeline-groups",),
              {"type": int, "help": "verifier groups taking turns so drafts overlap "
                                    "verification (default 1: off)"}),
    StackFlag("draft_ahead", ("--draft-ahead",),
              {"action": "store_true", "help": "verifiers use drafters' look-ahead drafts "
                                               "on a hit (default off)"}),
    StackFlag("speculative_depth", ("--speculative-depth",),
              {"choices": list(SPECULATIVE_DEPTHS), "help": "drafts verified per round: "
               "fixed (K every round; default) or adaptive (k in 0..K per sequence each "
               "step, to maximise measured tokens per second; DESIGN 4.11)"}),
    StackFlag("scheduling_policy", ("--scheduling-policy",),
              {"choices": [p.value for p in SchedulingPolicy],
               "help": "verifiers' admission order: fcfs (default; a request's priority "
                       "must be 0) or priority (lower `priority` first, as in vLLM)"}),
    StackFlag("drafter.mode", ("--drafter-mode",),
              {"choices": [m.value for m in DrafterMode],
               "help": "remote (default): drafter actors over gRPC; local: each verifier "
                       "runs the MTP modules in its own process, no drafter actors"}),
    StackFlag("drafter.replicas", ("--drafters",),
              {"type": drafter_count, "metavar": "N|auto:MIN-MAX",
               "help": "drafter actors: a fixed count, or auto:MIN-MAX to let the "
                       "controller scale them with the load (drafter.autoscale; default: "
                       "1, 0 in drafter mode local)"}),
    StackFlag("verifier.replicas", ("--verifiers",), {"type": int, "help": "verifier actors"}),
    StackFlag("drafter.num_gpus", ("--drafter-gpus",),
              {"type": float, "help": "GPUs per drafter (0: CPU)"}),
    StackFlag("verifier.num_gpus", ("--verifier-gpus",),
              {"type": float, "help": "GPUs per verifier (0: CPU)"}),
    StackFlag("verifier.tensor_parallel_size", ("-tp", "--tensor-parallel-size"),
              {"type": int, "metavar": "N", "help": "ranks of each verifier's target, one "
               "process each (tensor parallel; serve, up, generate, bench)"}),
    StackFlag("drafter.tensor_parallel_size", ("--drafter-tensor-parallel-size",),
              {"type": int, "metavar": "N", "help": "ranks of each drafter's MTP modules, "
               "one process each (tensor parallel; serve, up, drafter)"}),
)


def add_stack_args(p: argparse.ArgumentParser,
                   aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """`--config`, every `STACK_FLAGS` row (plus `aliases`: key -> extra names) and the
    token flags. Every flag defaults to None: unset flags leave the file's value."""
    p.add_argument("--config", type=Path,
                   help="config file (YAML or JSON, schema in docs/design.md); flags "
                        "override (default: none, every value's default)")
    add_flags(p, aliases=aliases)
    add_token_args(p)


def add_flags(p: argparse.ArgumentParser, keys: Sequence[str] | None = None,
              aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """The `STACK_FLAGS` rows with these keys (None: all), plus `aliases` (key -> extra
    names), each defaulting to None (unset: the file's value, else StackConfig's)."""
    rows = {flag.key: flag for flag in STACK_FLAGS}
    for key in keys if keys is not None else rows:
        flag = rows[key]
        names = (*flag.names, *(aliases or {}).get(flag.key, ()))
        options = dict(flag.options)
        if "action" not in options:  # --help shows StackConfig's default
            options["help"] = with_default(options.get("help"), flag.key)
        if "action" not in options and "choices" not in options:
            options.setdefault("metavar", flag.names[-1].lstrip("-").replace("-", "_").upper())
        p.add_argument(*names, dest=flag.dest, default=None, **options)


def with_default(text: str | None, key: str) -> str | None:
    """`text` with " (default: X)", X being StackConfig's default for `key`, unless the
    text already says its default (or there is no plain default to show)."""
    role, _, name = key.rpartition(".")
    cls = {"drafter": DrafterRoleConfig, "verifier": RoleConfig}.get(role, StackConfig)
    default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
    if "default" in (text or "") or default in (None, dataclasses.MISSING):
        return text
    return f"{text or ''} (default: {getattr(default, 'value', default)})".lstrip()


def flags_config(args: argparse.Namespace) -> StackConfig:
    """The given stack flags (and token) over StackConfig's defaults, validated: what a
    command without a config file (`drafter`, `verifier`, `generate`, `bench`) runs."""
    return StackConfig.from_dict(stack_overrides(args))


def stack_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The given stack flags (and the service token) as config keys, roles as sections;
    rows the command does not take are skipped."""
    out: dict[str, Any] = {}
    for flag in STACK_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        role, _, key = flag.key.rpartition(".")
        section = out.setdefault(role, {}) if role else out
        if isinstance(value, tuple):  # --drafters auto:MIN-MAX: autoscale, start at MIN
            section["autoscale"] = {"min_drafters": value[0], "max_drafters": value[1]}
            value = None  # NOTE: whatever count the file says
        elif flag.key == "drafter.replicas":  # a fixed count turns autoscaling off
            section["autoscale"] = None
        section[key] = value
    token = read_token(args) if hasattr(args, "token_file") else None
    if token:
        out["auth_token"] = token
    return out


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` on top of `base`; the gateway and role sections merge key by key."""
    out = dict(base)
    for key, value in overrides.items():
        if key in ("gateway", *ROLES) and isinstance(out.get(key), dict):
            base_policy, policy = out[key].get("autoscale"), value.get("autoscale")
            out[key] = {**out[key], **value}
            if isinstance(base_policy, dict) and isinstance(policy, dict):  # bounds only
                out[key]["autoscale"] = {**base_policy, **policy}
        else:
            out[key] = value
    return out


def file_with_flags(args: argparse.Namespace, extra: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The --config file (if any), then the stack flags, then `extra`, merged."""
    data = read_config_file(args.config) if args.config is not None else {}
    return merge(merge(data, stack_overrides(args)), extra or {})


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML/JSON mapping, or ValueError naming the file and what is wrong with it."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not YAML or JSON: {e}") from None
    if data is None:
        raise ValueError(f"--config {path}: the file is empty (write {{}} for every default)")
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping at the top level")
    return data

"""The stack flags: one table, one way to add them, one strict config-file reader, one way
to lay the flags over the file.

A row of `STACK_FLAGS` names a spine key (`spine/sections.py`: its type, default, bounds
and help live there, once) and the flags that set it: `--<key>` (the config file's key,
vLLM's flag: `--max-model-len`) first, then today's names, kept as aliases (`--max-len`).
`serve` and `up` take every row; the commands that run one engine or service in their
own process (`drafter`, `verifier`, `generate`, `bench`) take the rows that concern them
(`add_flags` with their keys; their lists are in `commands/model_args.py`) and resolve
them through the same `StackConfig` (`flags_config`), so a flag means the same, with the
same default, in every command. `tests/unit/test_stack_flags.py` fails until a new row
has an example value.

NOTE: light on purpose: every parser is built from here (`chainspec --help` < 1 s).
"""

from __future__ import annotations

import argparse
import json
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chainspec.commands.server_args import add_token_args, read_token
from chainspec.spine.sections import (
    DrafterRoleSection,
    GatewaySection,
    RoleSection,
    Section,
    StackSection,
)

if TYPE_CHECKING:
    from chainspec.cluster.config import StackConfig

SECTIONS: dict[str, type[Section]] = {"": StackSection, "drafter": DrafterRoleSection,
                                      "verifier": RoleSection, "gateway": GatewaySection}
ROLES = ("drafter", "verifier")


@dataclass(frozen=True)
class StackFlag:
    key: str  # spine key; "section.key" for a section (drafter, verifier, gateway)
    names: tuple[str, ...]  # the first long one is named in errors
    options: dict[str, Any] = field(default_factory=dict)  # add_argument extras

    @property
    def dest(self) -> str:
        # NOTE: a prefix, so that no stack flag collides with a command's own (serve --host)
        return "stack_" + self.key.replace(".", "_")

    @property
    def flag(self) -> str:
        return next(n for n in self.names if n.startswith("--"))


def drafter_count(text: str) -> int | tuple[int, int]:
    """`--drafters`: a count, or `auto:MIN-MAX` as (min, max)."""
    from chainspec.cluster.autoscale import AutoscalePolicy

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


def json_object(text: str) -> dict[str, Any]:
    """`--speculative-config '{"method": "mtp", ...}'`: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _row(key: str, *aliases: str, **options: Any) -> StackFlag:
    """A row whose first name is the key's own (`--max-model-len`), then `aliases`."""
    name = "--" + key.rpartition(".")[2].replace("_", "-")
    return StackFlag(key, (name, *aliases), options)


STACK_FLAGS = (
    _row("model", metavar="MODEL"),
    _row("revision"),
    _row("download_dir", metavar="DIR"),
    StackFlag("num_speculative_tokens", ("--num-speculative-tokens", "-k"),
              {"metavar": "K"}),
    _row("chain"),
    _row("speculative_config", type=json_object, metavar="JSON",
         help='vLLM\'s speculative config, e.g. \'{"method": "mtp", '
              '"num_speculative_tokens": 3, "chain": true, "depth": "adaptive", '
              '"draft_top_k": 8}\' (default: none); sets the options it names'),
    _row("max_num_seqs", "--max-seqs"),
    _row("drafter_max_num_seqs", "--drafter-max-seqs"),
    _row("max_model_len", "--max-len"),
    _row("dtype"),
    _row("kv_cache_memory_bytes", "--kv-cache-memory", metavar="BYTES"),
    _row("kv_cache_fraction", metavar="F"),
    _row("gpu_memory_utilization", metavar="F"),
    _row("block_size", "--kv-block-size"),
    _row("draft_top_k"),
    _row("enforce_eager", "--eager"),
    _row("enable_prefix_caching"),
    _row("state_snapshots", metavar="N"),
    _row("seed"),
    _row("grpc_host"),
    _row("namespace"),
    _row("health_interval_s", "--health-interval"),
    _row("drain_timeout_s", "--drain-timeout"),
    _row("draft_deadline_s", "--draft-deadline"),
    _row("max_waiting"),
    _row("pipeline_groups"),
    _row("draft_ahead"),
    _row("speculative_depth"),
    _row("scheduling_policy"),
    StackFlag("drafter.mode", ("--drafter-mode",)),
    StackFlag("drafter.replicas", ("--drafters",),
              {"type": drafter_count, "metavar": "N|auto:MIN-MAX",
               "help": "drafter actors: a fixed count, or auto:MIN-MAX to let the "
                       "controller scale them with the load (drafter.autoscale; default: "
                       "1, 0 in drafter mode local)"}),
    StackFlag("verifier.replicas", ("--verifiers",), {"help": "verifier actors"}),
    StackFlag("drafter.num_gpus", ("--drafter-gpus",), {"help": "GPUs per drafter (0: CPU)"}),
    StackFlag("verifier.num_gpus", ("--verifier-gpus",),
              {"help": "GPUs per verifier (0: CPU)"}),
    StackFlag("verifier.tensor_parallel_size", ("--tensor-parallel-size", "-tp"),
              {"metavar": "N", "help": "ranks of each verifier's target, one process each "
                                       "(tensor parallel; serve, up, generate, bench)"}),
    StackFlag("drafter.tensor_parallel_size", ("--drafter-tensor-parallel-size",),
              {"metavar": "N", "help": "ranks of each drafter's MTP modules, one process "
                                       "each (tensor parallel; serve, up, drafter)"}),
)
# the gateway's rows (`serve`, `gateway`): --host is the HTTP address there
GATEWAY_FLAGS = (
    StackFlag("gateway.host", ("--host",)),
    StackFlag("gateway.port", ("--port",)),
    StackFlag("gateway.served_model_name", ("--served-model-name", "--model-name"),
              {"metavar": "NAME"}),
    StackFlag("gateway.max_n", ("--max-n",)),
    StackFlag("gateway.max_in_flight", ("--max-in-flight",)),
    StackFlag("gateway.trust_request_chat_template", ("--trust-request-chat-template",)),
    StackFlag("gateway.chat_template", ("--chat-template",), {"metavar": "FILE|TEMPLATE"}),
    StackFlag("gateway.generation_config", ("--generation-config",),
              {"metavar": "auto|vllm|DIR"}),
    StackFlag("gateway.max_logprobs", ("--max-logprobs",)),
)
ROWS = {row.key: row for row in (*STACK_FLAGS, *GATEWAY_FLAGS)}


def spine_field(key: str):
    """(section class, pydantic FieldInfo) of a row's key."""
    section, _, name = key.rpartition(".")
    cls = SECTIONS[section]
    return cls, cls.model_fields[name]


def argparse_options(row: StackFlag) -> dict[str, Any]:
    """add_argument keywords of a row, from its spine type: bools on/off (`--x`,
    `--no-x`), numbers typed, Literals as choices, lists as several values; the help
    with the spine's default."""
    cls, info = spine_field(row.key)
    kind = _plain_type(info.annotation)
    options: dict[str, Any] = {"help": info.description}
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is typing.Literal:
        options["choices"] = list(typing.get_args(kind))
    elif typing.get_origin(kind) is list:
        options["nargs"] = "+"
    elif kind in (int, float):
        options["type"] = kind
    options.update(row.options)
    if "choices" not in options and "action" not in options:
        options.setdefault("metavar", row.flag.lstrip("-").replace("-", "_").upper())
    options["help"] = with_default(options.get("help"), info.get_default(
        call_default_factory=True))
    return options


def _plain_type(annotation: Any) -> Any:
    """`int | None` -> int; other annotations as they are."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"),
                                                               "UnionType", None)):
        return args[0] if len(args) == 1 else annotation
    return annotation


def with_default(text: str | None, default: Any) -> str | None:
    """`text` with " (default: X)" unless it already says its default (or there is no
    plain default to show)."""
    if "default" in (text or "") or default in (None, [], "") or isinstance(default, Section):
        return text
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{text or ''} (default: {shown})".lstrip()


def add_stack_args(p: argparse.ArgumentParser,
                   aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """`--config`, every `STACK_FLAGS` row (plus `aliases`: key -> extra names), the
    refused vLLM flags and the token flags. Every flag defaults to None: unset flags
    leave the file's value."""
    p.add_argument("--config", type=Path,
                   help="config file (YAML or JSON; keys are the flags' names, as in "
                        "vLLM: max_model_len, ...; docs/design.md); flags override "
                        "(default: none, every value's default)")
    add_flags(p, aliases=aliases)
    add_refused_flags(p)
    add_token_args(p)


def add_model_positional(p: argparse.ArgumentParser) -> None:
    """`chainspec serve MODEL` (vLLM's form); --model still works."""
    p.add_argument("positional_model", nargs="?", metavar="MODEL",
                   help="model directory (same as --model)")


def add_flags(p: argparse.ArgumentParser, keys: Sequence[str] | None = None,
              aliases: dict[str, tuple[str, ...]] | None = None,
              rows: Sequence[StackFlag] = STACK_FLAGS) -> None:
    """The rows with these keys (None: all of `rows`), plus `aliases` (key -> extra
    names), each defaulting to None (unset: the file's value, else the spine's)."""
    by_key = {row.key: row for row in rows}
    for key in keys if keys is not None else by_key:
        row = ROWS[key]
        names = (*row.names, *(aliases or {}).get(key, ()))
        p.add_argument(*names, dest=row.dest, default=None, **argparse_options(row))


BARE = ""  # a REFUSED flag's neutral "value": given alone, without one
_ONE = "chainspec runs one copy of the model per member (scale with --verifiers/--drafters)"
# vLLM flags chainspec cannot honour -> (the one value it can take, None: none; why)
REFUSED: dict[str, tuple[str | None, str]] = {
    "--quantization": (None, "weights load in --dtype"), "-q": (None, "weights load in "
                                                              "--dtype"),
    "--pipeline-parallel-size": ("1", "no pipeline parallelism; -tp splits a member"),
    "-pp": ("1", "no pipeline parallelism; -tp splits a member"),
    "--data-parallel-size": ("1", _ONE), "-dp": ("1", _ONE),
    "--kv-cache-dtype": ("auto", "the KV cache is kept in --dtype"),
    "--enable-lora": (None, "no LoRA adapters"), "--lora-modules": (None, "no LoRA adapters"),
    "--max-loras": (None, "no LoRA adapters"),
    "--cpu-offload-gb": ("0", "no weight offloading"), "--swap-space": (None, "preempted "
                                                                        "sequences recompute"),
    "--load-format": ("auto", "safetensors checkpoints only"),
    "--tokenizer": (None, "the model directory's tokenizer.json is used"),
    "--tokenizer-mode": ("auto", "the model directory's tokenizer.json is used"),
    "--enable-chunked-prefill": (BARE, "prefill is always chunked"),
    "--max-num-batched-tokens": (None, "the step budget follows --max-num-seqs and K"),
    "--enable-expert-parallel": (None, "experts split with -tp"),
    "--distributed-executor-backend": ("ray", "members are Ray actors"),
    "--trust-remote-code": (None, "no checkpoint code runs: the families chainspec "
                                  "implements need none"),
    "--enable-auto-tool-choice": (None, "no tool calling"),
    "--tool-call-parser": (None, "no tool calling"),
    "--reasoning-parser": (None, "no reasoning parser"),
    "--rope-scaling": (None, "RoPE scaling comes from the model's config.json"),
    "--api-key": (None, "a key never goes on the command line: --api-key-file or "
                        "$CHAINSPEC_API_KEY"),
}
SECRET = {"--api-key"}  # refused without echoing the value


class Refused(argparse.Action):
    """A vLLM flag chainspec cannot honour: one line naming it and why (its neutral
    value, if any, passes: `-pp 1` is fine)."""

    def __init__(self, option_strings, dest, neutral: str | None = None, why: str = "",
                 **kwargs) -> None:
        self.neutral, self.why = neutral, why
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.neutral is not None and (values or BARE) == self.neutral:
            return
        hidden = values is None or option_string in SECRET
        shown = option_string if hidden else f"{option_string} {values}"
        parser.exit(2, f"{parser.prog}: {shown} is not supported ({self.why})\n")


def add_refused_flags(p: argparse.ArgumentParser, names=None) -> None:
    """The REFUSED flags (or those `names` of them)."""
    for name, (neutral, why) in REFUSED.items():
        if names is not None and name not in names:
            continue
        p.add_argument(name, action=Refused, neutral=neutral, why=why,
                       dest="refused_" + name.lstrip("-").replace("-", "_"))


def flags_config(args: argparse.Namespace) -> StackConfig:
    """The given stack flags (and token) over the spine's defaults, validated: what a
    command without a config file (`drafter`, `verifier`, `generate`, `bench`) runs."""
    from chainspec.cluster.config import StackConfig

    return StackConfig.from_dict(stack_overrides(args), "flags", flag_names(args))


def flag_names(args: argparse.Namespace) -> dict[str, str]:
    """Dotted key -> the flag that set it (named in errors instead of the file)."""
    names = {row.key: row.flag for row in ROWS.values()
             if getattr(args, row.dest, None) is not None}
    if getattr(args, "positional_model", None) is not None:
        names["model"] = "MODEL"
    return names


def stack_overrides(args: argparse.Namespace,
                    rows: Sequence[StackFlag] = STACK_FLAGS) -> dict[str, Any]:
    """The given flags of `rows` (and the service token) as config keys, sections
    nested; rows the command does not take are skipped."""
    out: dict[str, Any] = {}
    positional = getattr(args, "positional_model", None)
    if positional is not None:
        if getattr(args, "stack_model", None) not in (None, positional):
            raise ValueError(f"MODEL {positional} and --model {args.stack_model} disagree: "
                             f"give one")
        out["model"] = positional
    for row in rows:
        value = getattr(args, row.dest, None)
        if value is None:
            continue
        section_name, _, key = row.key.rpartition(".")
        section = out.setdefault(section_name, {}) if section_name else out
        if isinstance(value, tuple):  # --drafters auto:MIN-MAX: autoscale, start at MIN
            section["autoscale"] = {"min_drafters": value[0], "max_drafters": value[1]}
            value = None  # NOTE: whatever count the file says
        elif row.key == "drafter.replicas":  # a fixed count turns autoscaling off
            section["autoscale"] = None
        section[key] = value
    token = read_token(args) if hasattr(args, "token_file") else None
    if token:
        out["auth_token"] = token
    return out


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` on top of `base`; the sections merge key by key."""
    out = dict(base)
    for key, value in overrides.items():
        if key in ("gateway", "speculative_config", *ROLES) and isinstance(out.get(key), dict) \
                and isinstance(value, dict):
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
    from chainspec.spine.read import speculative

    data = read_config_file(args.config) if args.config is not None else {}
    flags = speculative(stack_overrides(args), "flags", flag_names(args))
    return merge(merge(speculative(data, where(args)), flags), extra or {})


def where(args: argparse.Namespace) -> str:
    """How errors name the file (values set by flags name the flag instead)."""
    return f"--config {args.config}" if args.config is not None else "flags"


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML/JSON mapping, or ValueError naming the file and what is wrong with it."""
    import yaml

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

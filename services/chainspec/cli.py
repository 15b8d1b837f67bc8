"""The `chainspec` command line. Each subcommand lives in `chainspec.commands.<name>` and
provides `add_parser(subparsers)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

from chainspec.commands.help_format import OneLineErrorParser
from chainspec.spine.read import DeprecatedKey

# Module names under chainspec.commands, in help order.
COMMANDS = ("generate", "bench", "train_demo", "train_mtp", "drafter", "verifier", "up",
            "status", "scale", "drain", "down", "serve", "gateway", "health")


def _modules() -> dict[str, object]:
    return {name: importlib.import_module(f"chainspec.commands.{name}") for name in COMMANDS}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    parser = OneLineErrorParser(  # NOTE: subparsers inherit its class: one-line errors
        prog="chainspec",
        description="Chained MTP speculative decoding, split into drafter and verifier services.")
    sub = parser.add_subparsers(dest="command", required=True)
    handlers = {}
    for module in _modules().values():
        for name in module.add_parser(sub):
            handlers[name] = module
    return parser, handlers


def _warn_plainly(message, category, *_args, **_kwargs) -> None:
    """A deprecated config key: one line on stderr, no source line."""
    if issubclass(category, DeprecatedKey):
        print(f"chainspec: warning: {message}", file=sys.stderr, flush=True)
    else:
        _show_warning(message, category, *_args, **_kwargs)


_show_warning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _warn_plainly
    parser, handlers = build_parser()
    args = parser.parse_args(argv)
    try:
        return handlers[args.command].run(args)
    except (ValueError, OSError) as e:  # a usage error: one line, exit 2
        name = " ".join(filter(None, (args.command, getattr(args, "bench_mode", None))))
        print(f"chainspec {name}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""How the tools' `--help` reads: each option's default shown, and a bad argument a
single line on stderr (exit 2, no usage block, no traceback)."""

from __future__ import annotations

import argparse
from typing import NoReturn


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and " (default: X)" after an option's help, unless the
    help already says its default, the option is required, or it is a flag (off unless
    given). An option whose default is None must say what None means in its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or action.nargs == 0
                or action.default in (None, argparse.SUPPRESS) or "default" in text):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def shows_default(action: argparse.Action, formatter: argparse.HelpFormatter) -> bool:
    """Whether `--help` tells this option's default (tests hold every tool to it)."""
    if not action.option_strings or action.required or action.nargs == 0 \
            or argparse.SUPPRESS in (action.default, action.help):
        return True
    return "default" in formatter._get_help_string(action)  # noqa: SLF001


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors as one line, `prog: error: message (see prog --help)`, exit 2.
    No prefix matching (`allow_abbrev=False`): `--api-key sk-x` is never read as
    `--api-key-file`; its subparsers inherit the class, so the rule."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


"""The installed chainspec version, as every service reports it (Info calls, metrics)."""

from __future__ import annotations

import importlib.metadata


def chainspec_version() -> str:
    try:
        return importlib.metadata.version("chainspec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

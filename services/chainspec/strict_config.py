"""The one strict way a config dataclass is built from parsed YAML/JSON: a mapping, no
unknown keys (the error names them and lists the known ones), then the dataclass's own
validation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any


def check_mapping(data: Any, where: str, extra: Iterable[str] = (), cls=None) -> None:
    """ValueError unless `data` is a mapping whose keys are `cls`'s fields or `extra`."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    known |= set(extra)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")


def build_strict(cls, data: Any, where: str):
    """`cls(**data)`, after `check_mapping`."""
    check_mapping(data, where, cls=cls)
    return cls(**data)

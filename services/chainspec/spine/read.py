"""Reading the spine: parsed YAML/JSON (and flags) -> a validated section -> the runtime
fields, and back. Every problem is one `ConfigError` line naming the key and where the
value came from (the file, the flag, the chart value); old key names are accepted with a
`DeprecatedKey` warning naming the new one."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from chainspec.spine.sections import (
    GatewaySection,
    Section,
    SpeculativeSection,
    StackSection,
    inverted,
    renames,
    runtime_name,
)

# sections in a section
NESTED = {"drafter", "verifier", "gateway", "speculative_config", "autoscale"}


class ConfigError(ValueError):
    """One line: where, the key, what is wrong."""


class DeprecatedKey(FutureWarning):
    """A config key under its old name (accepted; the message names the new one)."""


def validate(cls: type[Section], data: Any, where: str,
             flags: Mapping[str, str] | None = None) -> Section:
    """`data` as a `cls`, after renaming old keys; `flags`: dotted key -> the flag that
    set it, named in errors instead of `where`."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    data = upgrade(cls, data, where)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe(e, cls, where, flags or {})) from None


def upgrade(cls: type[Section], data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Old key names -> new ones (a warning each); a gateway's `model_name` becomes the
    one-name list `served_model_name`."""
    out, old_names = {}, renames(cls)
    for key, value in data.items():
        new = old_names.get(key)
        if new is not None:
            warnings.warn(f"{where}: {key} is deprecated; use {new}", DeprecatedKey,
                          stacklevel=3)
            if inverted(cls, new) and isinstance(value, bool):
                value = not value
            if cls.model_fields[new].annotation == list[str] and isinstance(value, str):
                value = [value] if value else []
            if new in data:
                raise ConfigError(f"{where}: {key} and {new} are the same option; "
                                  f"give {new} only")
            key = new
        section = _section_of(cls, key)
        if section is not None and isinstance(value, Mapping):
            value = upgrade(section, value, f"{where}: {key}")
        out[key] = value
    return out


def _section_of(cls: type[Section], key: str) -> type[Section] | None:
    field = cls.model_fields.get(key)
    if field is None or key not in NESTED:
        return None
    for candidate in getattr(field.annotation, "__args__", (field.annotation,)):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None


def describe(error: ValidationError, cls: type[Section], where: str,
             flags: Mapping[str, str]) -> str:
    """The errors of one validation, on one line: unknown keys grouped per section (with
    the known ones), every other error as `key: problem (got value)`."""
    unknown: dict[tuple, list[str]] = {}
    parts = []
    for err in error.errors():
        loc = tuple(str(p) for p in err["loc"] if not isinstance(p, int))
        if err["type"] == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(loc[-1])
            continue
        loc = _strip_union(loc)
        key = ".".join(loc)
        source = flags.get(key)
        text = f"{source}" if source else f"{where}: {key}"
        parts.append(f"{text}: {_problem(err)}")
    for loc, keys in unknown.items():
        section = _walk(cls, loc)
        head = ": ".join((where, *loc))
        parts.insert(0, f"{head}: unknown keys {', '.join(sorted(keys))}; "
                        f"known: {', '.join(sorted(section.model_fields))}")
    return "; ".join(dict.fromkeys(parts))


def _strip_union(loc: tuple[str, ...]) -> tuple[str, ...]:
    """pydantic names the member of a union it tried (`int`, `constrained-str`, ...)."""
    return tuple(p for p in loc if "[" not in p and p not in ("int", "float", "str", "bool",
                                                                "constrained-str",
                                                                "literal", "list", "dict"))


def _walk(cls: type[Section], loc: tuple[str, ...]) -> type[Section]:
    for key in loc:
        cls = _section_of(cls, key) or cls
    return cls


def _problem(err: dict[str, Any]) -> str:
    kind, value = err["type"], err.get("input")
    expected = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or "
                "false", "string_type": "a string", "list_type": "a list",
                "dict_type": "a mapping", "model_type": "a mapping"}.get(kind)
    if kind in ("dict_type", "model_type", "list_type"):
        return f"expected {expected}, got {type(value).__name__}"
    if expected and isinstance(value, str):
        return f"expected {expected}, got the string {value!r} (write it without quotes)"
    if expected:
        return f"expected {expected}, got {value!r}"
    if kind in ("string_too_short", "string_pattern_mismatch"):
        return f"must not be empty or blank, got {value!r}"
    msg = err["msg"]
    return f"{msg[:1].lower()}{msg[1:]}, got {value!r}"


def runtime_fields(section: Section) -> dict[str, Any]:
    """The section's values under their runtime names (nested sections as dicts;
    `enforce_eager` turned into `use_graphs`)."""
    out = {}
    cls = type(section)
    for key in cls.model_fields:
        value = getattr(section, key)
        if isinstance(value, Section):
            value = runtime_fields(value)
        elif inverted(cls, key):
            value = not value
        out[runtime_name(cls, key)] = value
    return out


def file_form(cls: type[Section], runtime: Mapping[str, Any]) -> dict[str, Any]:
    """Runtime fields (a dataclass's asdict) under the keys files use: the inverse of
    `runtime_fields`, for round trips (the controller's copy, `up --detach`'s file)."""
    new_names = {runtime_name(cls, key): key for key in cls.model_fields}
    out = {}
    for name, value in runtime.items():
        key = new_names.get(name, name)
        if key not in cls.model_fields:
            continue
        section = _section_of(cls, key)
        if section is not None and isinstance(value, Mapping):
            value = file_form(section, value)
        elif inverted(cls, key):
            value = not value
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


SPECULATIVE_KEYS = {"num_speculative_tokens": "num_speculative_tokens", "chain": "chain",
                    "depth": "speculative_depth", "draft_top_k": "draft_top_k"}


def speculative(data: Mapping[str, Any], where: str,
                flags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`speculative_config` (vLLM's form) folded into the flat keys of the same source
    (a key given both ways must agree); a method other than mtp refused by name.
    NOTE: per source, before sources merge: a flag overrides a file either way."""
    data = dict(data)
    raw = data.pop("speculative_config", None)
    if raw is None:
        return data
    inner = (flags or {}).get("speculative_config") or f"{where}: speculative_config"
    spec = validate(SpeculativeSection, raw, inner)
    if spec.method not in ("mtp", "deepseek_mtp"):
        raise ConfigError(f"{inner}: method {spec.method!r} is not supported: chainspec "
                          f"drafts with the checkpoint's MTP modules (method mtp)")
    for key, flat in SPECULATIVE_KEYS.items():
        value = getattr(spec, key)
        if value is None:
            continue
        if flat in data and data[flat] != value:
            raise ConfigError(f"{inner}: {key} {value!r} contradicts {flat} {data[flat]!r}")
        data[flat] = value
    return data


__all__ = ["ConfigError", "DeprecatedKey", "GatewaySection", "StackSection", "describe",
           "file_form", "runtime_fields", "speculative", "upgrade", "validate"]

"""Append-only field numbers, enforced.

`protos/chainspec/v1/wire.lock` lists every field and enum value the protocol has ever
had, as `chainspec.v1.Message.field = number type`. A locked entry must stay as it is,
or, once removed from the .proto, have its number `reserved`. New entries are appended
by `python -m chainspec.rpc.build_protos`; editing or deleting a line by hand is a
protocol break and needs a new package version (`chainspec.v2`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from google.protobuf.descriptor_pb2 import (
    DescriptorProto,
    EnumDescriptorProto,
    FieldDescriptorProto,
)

LOCK_NAME = "wire.lock"
_HEADER = ("# Field and enum numbers of the chainspec wire protocol; append-only.\n"
           "# Maintained by `python -m chainspec.rpc.build_protos`; see rpc/wire_lock.py.\n")


class Schema:
    """Lock entries and reserved numbers of a set of proto files."""

    def __init__(self, files: Iterable) -> None:
        self.entries: dict[str, str] = {}  # "pkg.Msg.field" -> "3 repeated uint32"
        self.reserved: dict[str, set[int]] = {}  # "pkg.Msg" -> reserved numbers
        for f in files:
            for m in f.message_type:
                self._message(f"{f.package}.{m.name}", m)
            for e in f.enum_type:
                self._enum(f"{f.package}.{e.name}", e)

    def _message(self, scope: str, m: DescriptorProto) -> None:
        self.reserved[scope] = {n for r in m.reserved_range for n in range(r.start, r.end)}
        for fld in m.field:
            self.entries[f"{scope}.{fld.name}"] = f"{fld.number} {_field_type(fld)}"
        for nested in m.nested_type:
            self._message(f"{scope}.{nested.name}", nested)
        for e in m.enum_type:
            self._enum(f"{scope}.{e.name}", e)

    def _enum(self, scope: str, e: EnumDescriptorProto) -> None:
        # Enum reserved ranges are inclusive at both ends.
        self.reserved[scope] = {n for r in e.reserved_range for n in range(r.start, r.end + 1)}
        for v in e.value:
            self.entries[f"{scope}.{v.name}"] = f"{v.number} enum"


def _field_type(fld: FieldDescriptorProto) -> str:
    kind = fld.type_name or FieldDescriptorProto.Type.Name(fld.type).removeprefix("TYPE_").lower()
    return f"repeated {kind}" if fld.label == FieldDescriptorProto.LABEL_REPEATED else kind


def read_lock(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    lines = (ln.strip() for ln in path.read_text().splitlines())
    return dict(ln.split(" = ", 1) for ln in lines if ln and not ln.startswith("#"))


def write_lock(path: Path, entries: dict[str, str]) -> None:
    body = "".join(f"{k} = {v}\n" for k, v in sorted(entries.items()))
    path.write_text(_HEADER + body)


def violations(lock: dict[str, str], schema: Schema) -> list[str]:
    """Locked entries that the schema changed, or removed without reserving the number."""
    problems = []
    for name, locked in sorted(lock.items()):
        now = schema.entries.get(name)
        if now == locked:
            continue
        if now is not None:
            problems.append(f"{name}: locked as `{locked}`, now `{now}`")
            continue
        scope, number = name.rsplit(".", 1)[0], int(locked.split()[0])
        if number not in schema.reserved.get(scope, set()):
            problems.append(f"{name} (= {number}) was removed; add `reserved {number};` "
                            f"to {scope}")
    return problems

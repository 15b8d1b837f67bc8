"""The committed stubs match the .proto files, the protocol is documented, and field
numbers only ever get appended (wire.lock)."""

from __future__ import annotations

import importlib
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pb2 import DescriptorProto, FileDescriptorProto

from chainspec.rpc import build_protos, wire_lock
from chainspec.rpc.generated import GRPC_TOOLS_VERSION
from tests.tools import missing


@pytest.fixture(scope="module")
def descriptors():
    return build_protos.compile_descriptors()


def _module(proto_name: str, suffix: str = "_pb2"):
    stem = Path(proto_name).stem
    return importlib.import_module(f"chainspec.rpc.generated.v1.{stem}{suffix}")


def _strip_json_names(msgs) -> None:
    for m in msgs:
        for f in m.field:
            f.ClearField("json_name")
        _strip_json_names(m.nested_type)


def test_committed_descriptors_match_protos(descriptors) -> None:
    """Holds for any grpcio-tools version: an edited .proto needs regenerated stubs."""
    assert sorted(f.name for f in descriptors.file) == [
        "chainspec/v1/drafter.proto", "chainspec/v1/tensor.proto", "chainspec/v1/verifier.proto"]
    for fresh in descriptors.file:
        fresh = FileDescriptorProto.FromString(fresh.SerializeToString())
        fresh.ClearField("source_code_info")
        _strip_json_names(fresh.message_type)
        committed = FileDescriptorProto.FromString(_module(fresh.name).DESCRIPTOR.serialized_pb)
        assert committed == fresh, f"{fresh.name}: run `python -m chainspec.rpc.build_protos`"


def test_generated_tree_is_fresh(tmp_path: Path) -> None:
    """Byte-exact: catches hand edits of generated code and a stale import rewrite."""
    if build_protos.tools_version() != GRPC_TOOLS_VERSION:
        missing(f"grpcio-tools {GRPC_TOOLS_VERSION} (the stubs' generator)",
                f"{build_protos.tools_version()} is installed; the test extra pins it")
    build_protos.generate(tmp_path / "generated", update_lock=False)
    committed = build_protos.GENERATED_DIR

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and "__pycache__" not in p.parts}

    fresh, old = files(tmp_path / "generated"), files(committed)
    assert fresh.keys() == old.keys()
    stale = [name for name in fresh if fresh[name] != old[name]]
    assert not stale, f"stale generated files {stale}: run `python -m chainspec.rpc.build_protos`"


def test_services_and_methods_exist() -> None:
    from chainspec.rpc.generated.v1 import drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    drafter = _module("drafter.proto").DESCRIPTOR.services_by_name["Drafter"]
    assert drafter.full_name == "chainspec.v1.Drafter"
    draft, info = drafter.methods_by_name["Draft"], drafter.methods_by_name["Info"]
    assert draft.client_streaming and draft.server_streaming
    assert not info.client_streaming and not info.server_streaming
    verifier = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]
    gen = verifier.methods_by_name["Generate"]
    assert not gen.client_streaming and gen.server_streaming
    assert {"Abort", "Info"} <= set(verifier.methods_by_name)
    methods = {drafter_pb2_grpc: ("Drafter", ["Draft", "Info"]),
               verifier_pb2_grpc: ("Verifier", ["Generate", "Abort", "Info"])}
    with grpc.insecure_channel("localhost:1") as channel:  # never connects
        for mod, (svc, names) in methods.items():
            stub = getattr(mod, f"{svc}Stub")(channel)
            servicer = getattr(mod, f"{svc}Servicer")
            assert callable(getattr(mod, f"add_{svc}Servicer_to_server"))
            for name in names:
                assert callable(getattr(stub, name)) and callable(getattr(servicer, name))


def _undocumented(f: FileDescriptorProto) -> list[str]:
    have = {tuple(loc.path) for loc in f.source_code_info.location
            if loc.leading_comments.strip()}
    missing = []

    def need(path: tuple[int, ...], what: str) -> None:
        if path not in have:
            missing.append(f"{f.name}: {what}")

    def message(path: tuple[int, ...], m: DescriptorProto) -> None:
        need(path, m.name)
        for j, fld in enumerate(m.field):
            need((*path, 2, j), f"{m.name}.{fld.name}")
        for j, o in enumerate(m.oneof_decl):
            if not o.name.startswith("_"):  # synthetic oneof of a proto3 `optional`
                need((*path, 8, j), f"{m.name}.{o.name}")

    for i, m in enumerate(f.message_type):
        message((4, i), m)
    for i, e in enumerate(f.enum_type):
        need((5, i), e.name)
        for j, v in enumerate(e.value):
            need((5, i, 2, j), f"{e.name}.{v.name}")
    for i, s in enumerate(f.service):
        need((6, i), s.name)
        for j, meth in enumerate(s.method):
            need((6, i, 2, j), f"{s.name}.{meth.name}")
    return missing


def test_every_protocol_element_is_documented(descriptors) -> None:
    missing = [m for f in descriptors.file for m in _undocumented(f)]
    assert not missing, f"add a leading comment to: {missing}"


def test_wire_lock_holds_and_is_complete(descriptors) -> None:
    lock_path = build_protos.PROTO_ROOT / "chainspec" / "v1" / wire_lock.LOCK_NAME
    lock = wire_lock.read_lock(lock_path)
    schema = wire_lock.Schema(descriptors.file)
    assert wire_lock.violations(lock, schema) == []
    missing = sorted(schema.entries.keys() - lock.keys())
    assert not missing, f"not in wire.lock (run build_protos): {missing}"


def _tensor_file(descriptors) -> FileDescriptorProto:
    f = next(f for f in descriptors.file if f.name.endswith("tensor.proto"))
    return FileDescriptorProto.FromString(f.SerializeToString())


@pytest.mark.parametrize("edit, problem", [
    (lambda m: setattr(m.field[1], "number", 9), "locked as `2 repeated uint32`, now `9"),
    (lambda m: setattr(m.field[0], "type", m.field[0].TYPE_STRING), "now `1 string`"),
    (lambda m: m.field.pop(3), "add `reserved 4;` to chainspec.v1.Tensor"),
])
def test_wire_lock_rejects_breaking_edits(descriptors, edit, problem) -> None:
    f = _tensor_file(descriptors)
    lock = wire_lock.Schema([f]).entries
    edit(f.message_type[0])
    problems = wire_lock.violations(lock, wire_lock.Schema([f]))
    assert len(problems) == 1 and problem in problems[0], problems


def test_wire_lock_allows_appends_and_reserved_removals(descriptors) -> None:
    f = _tensor_file(descriptors)
    lock = wire_lock.Schema([f]).entries
    tensor = f.message_type[0]
    tensor.field.pop(3)
    tensor.reserved_range.add(start=4, end=5)
    tensor.field.add(name="extra", number=5, type=tensor.field[0].TYPE_UINT32)
    assert wire_lock.violations(lock, wire_lock.Schema([f])) == []


def test_wire_lock_roundtrips(tmp_path: Path, descriptors) -> None:
    entries = wire_lock.Schema(descriptors.file).entries
    wire_lock.write_lock(tmp_path / "x.lock", entries)
    assert wire_lock.read_lock(tmp_path / "x.lock") == entries

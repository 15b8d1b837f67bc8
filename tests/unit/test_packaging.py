"""Packaging: every third-party module imported under services/ is declared in
pyproject.toml (core, or the one extra its feature needs), the build backend understands
the licence string, triton is asked for only where it installs, Ray is bounded above for
the internals used, the Dockerfile's extras exist, and the image's lock file pins every
dependency within pyproject's ranges."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CORE = [Requirement(r) for r in PROJECT["project"]["dependencies"]]
EXTRAS = {name: [Requirement(r) for r in reqs]
          for name, reqs in PROJECT["project"]["optional-dependencies"].items()}
# modules a feature behind an extra imports (lazily, or in that feature's files only)
EXTRA_ONLY = {"matplotlib": "bench", "httpx": "bench", "grpc_tools": "test", "triton": "gpu"}
RAY_INTERNALS = ("ray._private", "ray.experimental")


def imported_modules() -> dict[str, set[str]]:
    """Top-level third-party module -> the files importing it (any depth, lazy too)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "services").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 \
                and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top != "chainspec" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def full_imports() -> set[str]:
    names = set()
    for path in (ROOT / "services").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return names


def names(reqs: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in reqs}


@functools.cache
def providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    dists = providers().get(module)
    assert dists, f"{module} is imported under services/ but no installed package provides it"
    return {canonicalize_name(d) for d in dists}


def test_every_imported_module_is_declared() -> None:
    modules = imported_modules()
    assert {"torch", "openai", "starlette", "jinja2", "ray"} <= set(modules)  # the scan works
    for module, files in sorted(modules.items()):
        dists = distributions(module)
        where = names(EXTRAS[EXTRA_ONLY[module]]) if module in EXTRA_ONLY else names(CORE)
        scope = f"extra {EXTRA_ONLY[module]!r}" if module in EXTRA_ONLY else "dependencies"
        assert dists & where, f"{module} ({', '.join(sorted(files))}) comes from " \
                              f"{sorted(dists)}, not in pyproject's {scope}"


def test_the_build_backend_reads_the_licence_string() -> None:
    """PEP 639's `license = "<SPDX>"` needs setuptools >= 77 (older ones reject it)."""
    assert isinstance(PROJECT["project"]["license"], str)
    (backend,) = [Requirement(r) for r in PROJECT["build-system"]["requires"]
                  if Requirement(r).name == "setuptools"]
    floors = [Version(s.version) for s in backend.specifier if s.operator in (">=", "==")]
    assert floors and min(floors) >= Version("77"), backend


def test_triton_only_where_it_installs() -> None:
    (triton,) = [r for r in CORE if r.name == "triton"]
    assert triton.marker is not None
    env = default_environment()
    for system, machine, wanted in (("Linux", "x86_64", True), ("Darwin", "arm64", False),
                                    ("Windows", "AMD64", False)):
        env.update(platform_system=system, platform_machine=machine)
        assert triton.marker.evaluate(env) is wanted, (system, machine)


def test_ray_is_bounded_above_for_its_internals() -> None:
    used = sorted(n for n in full_imports() if n.startswith(RAY_INTERNALS))
    assert used, "no Ray internals used any more: the upper bound may go"
    for reqs in (CORE, *EXTRAS.values()):
        for r in reqs:
            if r.name == "ray":
                assert any(s.operator in ("<", "<=") for s in r.specifier), (r, used)
    installed = Version(importlib.metadata.version("ray"))
    assert all(installed in r.specifier for r in CORE if r.name == "ray")


def test_the_dockerfiles_extras_exist() -> None:
    texts = [(ROOT / "deploy" / f).read_text() for f in ("Dockerfile", "README.md")]
    values = [v for text in texts for v in re.findall(r"EXTRAS=([\w,-]*)", text)]
    assert "gpu" in values  # the CUDA default
    for value in values:
        for extra in filter(None, value.split(",")):
            assert extra in EXTRAS, f"deploy/ names the extra {extra!r}; pyproject has " \
                                    f"{sorted(EXTRAS)}"


def test_the_image_lock_pins_every_dependency_within_range() -> None:
    """deploy/requirements.lock (deploy/lock.sh) is chainspec[gpu]'s resolution for the
    image: every core and gpu requirement applying to Linux x86_64 is pinned within its
    range (a pyproject change without a new lock fails here)."""
    lock = {}
    for line in (ROOT / "deploy" / "requirements.lock").read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, version = line.split("==")
            lock[canonicalize_name(name)] = Version(version.split(";")[0].strip())
    env = {**default_environment(), "platform_system": "Linux", "platform_machine": "x86_64",
           "sys_platform": "linux", "python_version": "3.11", "extra": ""}
    for r in [*CORE, *EXTRAS["gpu"]]:
        if r.marker is None or r.marker.evaluate(env):
            name = canonicalize_name(r.name)
            assert name in lock, f"{r.name} is not in deploy/requirements.lock"
            assert r.specifier.contains(lock[name], prereleases=True), (r, lock[name])
    assert lock["torch"] == Version("2.13.0")
    assert "chainspec" not in lock

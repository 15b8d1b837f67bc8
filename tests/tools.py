"""Finding what the tests drive: Helm 3 (on PATH or in ./.tools/bin, see `make tools`),
the kubernetes-validate and transformers packages, openssl, promtool, Prometheus and aiperf. A
missing tool skips the test with the reason, or fails it under CHAINSPEC_REQUIRE_TOOLS=1
(set by .ci/run), so a CI run can never pass by skipping. The upstream CRD schemas are
vendored in tests/helm/crds: a missing one is a broken checkout and always fails."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "chainspec"
CRD_DIR = REPO / "tests" / "helm" / "crds"  # vendored upstream copies, see its README
REQUIRE_ENV = "CHAINSPEC_REQUIRE_TOOLS"


def missing(what: str, how: str) -> NoReturn:
    """Skip (or, under CHAINSPEC_REQUIRE_TOOLS=1, fail) for a tool that is not there."""
    message = f"{what} is missing: {how}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_ENV}=1 turns this skip into a failure)",
                    pytrace=False)
    pytest.skip(message)


def helm() -> str:
    """Path of a Helm 3 binary: PATH first, then ./.tools/bin."""
    path = _find_helm()
    if path is None:
        missing("helm (Helm 3)", "run `make tools` to install it into .tools/bin")
    return path


@functools.cache
def _find_helm() -> str | None:
    for candidate in (shutil.which("helm"), REPO / ".tools" / "bin" / "helm"):
        if candidate and Path(candidate).is_file() and _is_helm3(str(candidate)):
            return str(candidate)
    return None


def _is_helm3(path: str) -> bool:
    try:
        out = subprocess.run([path, "version", "--short"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.startswith("v3.")


def kubernetes_validate():
    """The kubernetes_validate module."""
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate", "install the test extra (pip install kubernetes-validate)")
    return kubernetes_validate


def transformers():
    """The transformers module (reference implementation for parity tests)."""
    try:
        import transformers
    except ImportError:
        missing("transformers", "install the test extra (pip install -e '.[test]')")
    return transformers


def openssl() -> str:
    """Path of the openssl command (test certificates)."""
    return shutil.which("openssl") or missing("openssl", "install Debian's openssl package")


def crd_dir() -> Path:
    """The folder with the vendored upstream CRDs; a missing one is a broken checkout, so
    it fails rather than skips."""
    if not (CRD_DIR / "ray.io_rayclusters.yaml").is_file():
        pytest.fail(f"the vendored CRD schemas are missing from {CRD_DIR} (see its README)",
                    pytrace=False)
    return CRD_DIR


def redis_server() -> str:
    """Path of redis-server (GCS fault tolerance tests; Debian's redis-server package)."""
    return shutil.which("redis-server") or missing(
        "redis-server", "run `make tools` (deploy/install-redis.sh installs Debian's "
                        "redis-server)")


PROMETHEUS_HOW = "run `make tools` (deploy/install-prometheus.sh installs Debian's prometheus)"


def promtool() -> str:
    """Path of promtool (on PATH)."""
    return shutil.which("promtool") or missing("promtool", PROMETHEUS_HOW)


def prometheus() -> str:
    """Path of the Prometheus server (on PATH)."""
    return shutil.which("prometheus") or missing("prometheus", PROMETHEUS_HOW)


def promtool_check(*args: str, stdin: str | None = None) -> None:
    """`promtool check ...`; fails the test with promtool's output unless it succeeds."""
    proc = subprocess.run([promtool(), "check", *args], input=stdin, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"promtool check {' '.join(args)}:\n{proc.stdout}{proc.stderr}"


AIPERF_HOW = "run `make tools` (deploy/install-aiperf.sh installs it into its own venv)"


def aiperf() -> str:
    """Path of NVIDIA's aiperf: $CHAINSPEC_AIPERF, PATH, then the venv `make tools` makes."""
    cache = Path(os.environ.get("CHAINSPEC_TOOLS_CACHE", Path.home() / ".cache" / "chainspec"))
    for candidate in (os.environ.get("CHAINSPEC_AIPERF"), shutil.which("aiperf"),
                      cache / "aiperf-venv" / "bin" / "aiperf"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    missing("aiperf", AIPERF_HOW)

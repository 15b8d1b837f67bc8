"""Import direction between modules that used to import each other: a module loads
without the one that uses it (checked in a fresh interpreter, so nothing is cached)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module,must_not_load", [
    ("chainspec.rpc.call_metrics", "chainspec.rpc.server"),  # via rpc/handlers.py
    ("chainspec.metrics.service", "chainspec.rpc.server"),
    ("chainspec.gateway.app", "chainspec.gateway.routes"),  # the app is built in asgi.py
    ("chainspec.gateway.routes", "chainspec.gateway.asgi"),
])
def test_module_loads_without_its_user(module: str, must_not_load: str) -> None:
    code = (f"import sys, {module}; "
            f"sys.exit(1 if {must_not_load!r} in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

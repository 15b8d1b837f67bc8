"""Shared by the kernel tests: triton, or a skip (a failure under CHAINSPEC_REQUIRE_TOOLS=1)."""

from __future__ import annotations

from chainspec.kernels.triton_support import triton_available
from tests.tools import missing


def require_triton() -> None:
    """Skip without triton (fail under CHAINSPEC_REQUIRE_TOOLS=1, as CI sets)."""
    if not triton_available():
        missing("triton", "pip install -e '.' (triton is a product dependency)")

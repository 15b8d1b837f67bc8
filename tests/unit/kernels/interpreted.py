"""Run a test module's `check_*` functions in a fresh Python with TRITON_INTERPRET=1.

NOTE: why a subprocess: Triton's own library functions (tl.zeros, tl.max, tl.sum,
tl.argmax, ...) are @jit functions whose interpreted form is chosen when triton is first
imported, so `kernels_on_cpu()` in this (already importing) process cannot run kernels
that use them. One subprocess per test module keeps the cost at one import (~3 s).

The first module whose fixture runs starts every collected module's run, two at a time
(CI has two cores; each run is one single-threaded Python): the later modules' results
are ready, or nearly, when their tests come.

Usage in a test module:

    RESULTS = interpreted_results(__name__)      # a module-scoped fixture
    def check_x(): ...                           # runs inside kernels_on_cpu()
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from tests.tools import REPO
from tests.unit.kernels.support import require_triton

TIMEOUT_S = 120
_MODULES: list[str] = []  # every module that asked for a fixture, in collection order
_RUNS: dict[str, Future] = {}  # module -> its interpreter run, once started
# NOTE: at exit the workers finish their current run only, never the queued ones
_POOL = ThreadPoolExecutor(2, thread_name_prefix="triton-interpreter")


def check_names(module) -> list[str]:
    return sorted(n for n in vars(module) if n.startswith("check_"))


def assert_kernel_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact, except bf16 results under the interpreter: numpy has no bf16 and the
    interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even, so there one
    bf16 ulp is allowed (tests/gpu checks the same cases exactly)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    if got.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0 ** -7, atol=0)
    else:
        assert torch.equal(got, want), (got - want).abs().max()


def interpreted_results(module_name: str):
    """A module-scoped fixture: {check name: "" when it passed, else its traceback}."""

    _MODULES.append(module_name)

    @pytest.fixture(scope="module")
    def fixture() -> dict[str, str]:
        require_triton()
        for name in (module_name, *_MODULES):  # ours first, then the others
            if name not in _RUNS:
                _RUNS[name] = _POOL.submit(_interpret, name)
        proc = _RUNS[module_name].result()
        lines = proc.stdout.strip().splitlines()
        assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stderr[-4000:]}"
        return json.loads(lines[-1])

    return fixture


def _interpret(module_name: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    return subprocess.run([sys.executable, "-m", __name__, module_name], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def _main(module_name: str) -> None:
    from chainspec.kernels.triton_support import kernels_on_cpu

    module = importlib.import_module(module_name)
    out = {}
    for name in check_names(module):
        try:
            with kernels_on_cpu():
                getattr(module, name)()
            out[name] = ""
        except Exception:  # noqa: BLE001 -- reported to the parent test
            out[name] = traceback.format_exc()
    print(json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1])

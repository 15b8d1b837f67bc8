"""Run kernel checks under Triton's interpreter in a child process.

TRITON_INTERPRET=1 must be set before triton is imported, and it then makes every kernel
in that process an interpreted one, so it never goes into the shared pytest process. A
check is a module-level function that takes no arguments and returns JSON-able results
(e.g. {case name: max error}); the test calls it once through `run_interpreted` (a
module-scoped fixture) and asserts on each entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.tools import REPO

_CHILD = """
import importlib, json, sys, torch
torch.set_num_threads(1)
module, name = sys.argv[1].split(":")
result = getattr(importlib.import_module(module), name)()
print("\\n@@RESULT@@" + json.dumps(result))
"""


def run_interpreted(target: str, timeout: float = 300) -> object:
    """Call `target` ("package.module:function") in a child Python with TRITON_INTERPRET=1
    and return what it returned; a crash fails with the child's output."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "services"),
                                          os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _CHILD, target], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    marker = proc.stdout.rfind("@@RESULT@@")
    if proc.returncode != 0 or marker < 0:
        raise AssertionError(f"{target} under TRITON_INTERPRET=1 failed "
                             f"(rc {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return json.loads(proc.stdout[marker + len("@@RESULT@@"):])

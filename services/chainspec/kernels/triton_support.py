"""What every Triton kernel here shares: is Triton there, which path a call takes, how a
kernel runs on CPU tensors in tests, and how it is compiled ahead of time for a GPU.

Dispatch rule (one call site per kernel, in its public function):

    if use_kernel(q):          # CUDA tensors and triton imports, or inside kernels_on_cpu()
        grid_launch = launcher(my_kernel, q)
        grid_launch[grid](...)
    else:
        torch reference

`kernels_on_cpu()` is for tests: inside it, CPU tensors go to the kernel, which Triton's
interpreter runs. NOTE: the interpreter only works when TRITON_INTERPRET=1 was set before
triton itself was imported (triton.language's own helpers are jit functions too), and it
then turns every kernel defined in the process into an interpreted one. So tests run it in
a subprocess (tests/unit/kernels/interpreted.py), never in the shared pytest process.

`aot_compile` builds a cubin for an sm_XX target without a GPU (Triton's own compiler and
the ptxas it ships) and reads shared memory, registers and spills, for tests that keep
every kernel within the limits of the GPUs we serve on.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_ON_CPU = contextvars.ContextVar("chainspec_kernels_on_cpu", default=False)

# Per-block shared memory a kernel may use, by compute capability (CUDA guide, table 21).
SHARED_LIMIT_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
MAX_REGISTERS = 255


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works (it is a dependency, but CPU installs may lack it)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_on() -> bool:
    """True when TRITON_INTERPRET=1 is set (kernels defined now are interpreted)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def kernels_on_cpu() -> Iterator[None]:
    """Inside this block, kernels take CPU tensors too and run in Triton's interpreter."""
    if not triton_available() or not interpreter_on():
        raise RuntimeError("kernels_on_cpu() needs triton imported with TRITON_INTERPRET=1")
    token = _ON_CPU.set(True)
    try:
        yield
    finally:
        _ON_CPU.reset(token)


def use_kernel(t: torch.Tensor) -> bool:
    """Whether a kernel (not the torch reference) handles a call on tensor `t`."""
    if not triton_available():
        return False
    return t.is_cuda or (_ON_CPU.get() and t.device.type == "cpu")


def interpreted_bf16_dot() -> bool:
    """True when bf16 tl.dot must be done in fp32: Triton 3.9's interpreter multiplies the
    raw uint16 storage of bf16 operands (numpy has no bf16), so results are garbage."""
    return interpreter_on()


def launcher(kernel: Any, t: torch.Tensor) -> Any:
    """The object to index with a grid and call. Today the kernel itself (interpreted under
    TRITON_INTERPRET=1); one place to adapt launches later."""
    if t.device.type == "cpu" and not interpreter_on():
        raise RuntimeError(f"{kernel.__name__} on CPU tensors needs TRITON_INTERPRET=1")
    return kernel


# ---------------------------------------------------------------------------------------
# Ahead-of-time compilation (tests and `make gpu-check` planning; no GPU needed).


@dataclass(frozen=True)
class AotResult:
    """One compiled kernel variant: the cubin and the resources it claims per block."""

    name: str
    capability: int
    cubin: bytes
    shared_bytes: int
    num_warps: int
    registers: int | None  # per thread, from cuobjdump; None when it could not be read
    spill_bytes: int | None  # local memory + stack per thread (spills land there)

    def problems(self) -> list[str]:
        """Limits this variant breaks on its target (empty when it fits)."""
        out = []
        if not self.cubin:
            out.append("empty cubin")
        limit = SHARED_LIMIT_BYTES[self.capability]
        if self.shared_bytes > limit:
            out.append(f"shared memory {self.shared_bytes} B > {limit} B on sm_{self.capability}")
        if self.registers is not None and self.registers > MAX_REGISTERS:
            out.append(f"{self.registers} registers per thread > {MAX_REGISTERS}")
        if self.spill_bytes:
            out.append(f"{self.spill_bytes} B of register spills (local/stack)")
        return out


def aot_compile(kernel: Any, signature: Mapping[str, str], constexprs: Mapping[str, Any],
                capability: int, num_warps: int = 4, num_stages: int = 3,
                aligned: bool = True, divisible: tuple[str, ...] = ()) -> AotResult:
    """Compile `kernel` (a @triton.jit function) for sm_<capability> and read its resources.

    signature: Triton type strings for the runtime arguments, e.g. {"x": "*fp16", "n": "i32"};
    constexprs: values of the tl.constexpr arguments. num_warps/num_stages default to a
    plain launch's (4, 3): pass what the kernel's launch passes. With `aligned`, pointer
    arguments are declared 16-byte aligned, as torch allocations are, so loads vectorise
    like at run time.
    divisible: integer arguments to declare multiples of 16, as Triton's launcher does for
    any int argument that is one (strides like heads * head_dim): without it, loads indexed
    by those strides do not vectorise and register counts read far higher than at run time.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    for name in constexprs:
        sig.setdefault(name, "constexpr")
    marked = [n for n, ty in signature.items() if aligned and ty.startswith("*")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in [*marked, *divisible]}
    src = ASTSource(fn=kernel, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       "enable_fp_fusion": True})
    cubin = compiled.asm["cubin"]
    registers, spills = cubin_resources(cubin)
    return AotResult(kernel.fn.__name__, capability, cubin, compiled.metadata.shared,
                     compiled.metadata.num_warps, registers, spills)


def cubin_resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, spill bytes) read with the cuobjdump Triton ships; (None, None)
    when the tool is missing or its output is not understood."""
    tool = _cuobjdump()
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True, timeout=60)
    regs = re.search(r"REG:(\d+)", proc.stdout)
    if proc.returncode != 0 or regs is None:
        return None, None
    spill = sum(int(m) for m in re.findall(r"(?:STACK|LOCAL):(\d+)", proc.stdout))
    return int(regs.group(1)), spill


@functools.cache
def _cuobjdump() -> str | None:
    if not triton_available():
        return None
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.is_file() else None

"""One GPU check (issue 12, item 5): the GPU tests, then a timing pass, in one report.

    make gpu-check                         # here: the venv; without CUDA, one line, exit 0
    PYTHONPATH=services:. python3 benchmarks/gpu_check.py --out benchmarks/results/gpu
    .venv/bin/python benchmarks/gpu_check.py --force-cpu-dry-run --out /tmp/gpu_dry

1. `python -m pytest -q tests/gpu` in a subprocess (graphs vs eager, kernels vs reference,
   lossless on CUDA, paged parity); its outcome counts go into the JSON.
2. Timing sections in process, each with a time budget (sizes past it are skipped and
   listed): draft round graph vs eager per bucket, verify step per batch, paged attention
   kernel vs torch reference at 1k/8k/32k context on Llama-3-8B-shaped layers, small
   kernels, the fused MoE kernel vs reference on a DeepSeek-V3-shaped layer (decode,
   verify and prefill rows), and the Qwen3.5 / MiMo-V2-Flash / DeepSeek-V3 families'
   graph-vs-eager and lossless checks on tiny random checkpoints (a False check is the
   section's error), and the TP=1 verify step on 2 and 4 layers shaped like an 8B Llama
   (`benchmarks/tp_step.py`'s shapes: the single-device baseline of tensor parallelism).
   A section whose dependency is not on main records {"skipped": why}; one that raises
   records {"error": ...} and the run exits 1.
Writes gpu_check.json and gpu_check.md under --out. Medians of CUDA-event times.
`--force-cpu-dry-run` runs every section on CPU with tiny shapes (kernels in Triton's
interpreter) to catch bugs before a GPU run; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "services"), str(ROOT)):  # works without PYTHONPATH too
    if p not in sys.path:
        sys.path.insert(0, p)
# NOTE: Triton reads TRITON_INTERPRET when it is imported, so the CPU dry run (kernels in
# the interpreter) must set it before torch or triton load.
if "--force-cpu-dry-run" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from benchmarks.gpu.report import document, pytest_counts, write  # noqa: E402
from benchmarks.gpu.timing import Budget, Context  # noqa: E402

TESTS_TIMEOUT_S = 210
BUDGETS_S = {"draft_round": 30, "verify_step": 30, "attention": 90, "small_kernels": 20,
             "moe": 60, "family_graphs": 60, "tp_step": 60}


def sections():
    """name -> section function; imported late so a broken module is one section's error."""
    from benchmarks.gpu.attention import attention_section
    from benchmarks.gpu.engine_steps import draft_round_section, verify_step_section
    from benchmarks.gpu.family_graphs import family_graphs_section
    from benchmarks.gpu.moe import moe_section
    from benchmarks.gpu.small_kernels import small_kernels_section
    from benchmarks.gpu.tp_step import tp_step_section
    return {"draft_round": draft_round_section, "verify_step": verify_step_section,
            "attention": attention_section, "small_kernels": small_kernels_section,
            "moe": moe_section,
            "family_graphs": family_graphs_section, "tp_step": tp_step_section}


def run_tests(timeout_s: float) -> dict:
    # NOTE: one file failing to import (a package missing on the GPU box) is an error in
    # the counts, not the end of the run.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "tests/gpu"]
    extra = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": "services:." + (f":{extra}" if extra else "")}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout
        return {"returncode": None, "error": f"timed out after {timeout_s:.0f} s",
                "tail": (out or "")[-2000:], "seconds": time.monotonic() - t0}
    return {**pytest_counts(proc.stdout), "returncode": proc.returncode,
            "seconds": time.monotonic() - t0, "command": shlex.join(cmd),
            "tail": "\n".join(proc.stdout.strip().splitlines()[-15:])}


def run_section(name: str, fn, ctx: Context, budget_s: float) -> dict:
    print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
    budget = Budget(budget_s)
    try:
        result = fn(ctx, budget)
    except Exception as exc:  # one section's failure is reported, the others still run
        tb = traceback.format_exc().strip().splitlines()
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": tb[-8:]}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["seconds"] = round(budget.elapsed(), 2)
    return result


def meta(ctx: Context, started: str) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = ctx.device.type == "cuda"
    env = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return {"command": env + shlex.join(["python3", *sys.argv]),
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})",
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version(), "dtype": str(ctx.dtype),
            "dry_run": ctx.dry_run, "started": started}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    ap.add_argument("--force-cpu-dry-run", action="store_true",
                    help="run the sections on CPU with tiny shapes (no GPU needed)")
    ap.add_argument("--skip-tests", action="store_true", help="timing sections only")
    ap.add_argument("--only", nargs="*", choices=sorted(BUDGETS_S), help="these sections")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.force_cpu_dry_run and not torch.cuda.is_available():
        print(f"gpu-check: skipped, no CUDA device visible to torch {torch.__version__} "
              "(run it on a GPU machine; --force-cpu-dry-run exercises it on CPU)")
        return 0
    dry = args.force_cpu_dry_run
    ctx = Context(torch.device("cpu") if dry else torch.device("cuda"),
                  torch.float32 if dry else torch.bfloat16, dry,
                  repeats=1 if dry else 10, warmup=0 if dry else 3)
    t0, started = time.monotonic(), time.strftime("%Y-%m-%d %H:%M:%S")
    tests = {"skipped_run": "--skip-tests" if args.skip_tests else "dry run"} \
        if dry or args.skip_tests else run_tests(TESTS_TIMEOUT_S)
    chosen = args.only or list(BUDGETS_S)
    results = {name: run_section(name, fn, ctx, BUDGETS_S[name])
               for name, fn in sections().items() if name in chosen}
    info = meta(ctx, started) | {"total_s": round(time.monotonic() - t0, 1)}
    doc = document(info, tests, results)
    js, md = write(doc, args.out)
    print(f"gpu-check: {'ok' if doc['ok'] else 'FAILED'} in {info['total_s']} s; "
          f"wrote {js} and {md}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Metrics overhead: tokens/s of the same speculative engine (verifier + in-process
drafter, greedy) with metrics off and on, in one process, runs interleaved.

    .venv/bin/python benchmarks/metrics_overhead.py [--model DIR] [--batch 1 8] \
        [--max-tokens 64] [--repeats 9] [--out benchmarks/results/metrics_overhead]

Without --model it writes the synthetic checkpoint of the demo's planned shape that
benchmarks/services_bench.py used (hidden 192, 14 layers; `write_tiny_model` from
tests/integration/tiny_checkpoint.py), plus the test suite's tiny model as the worst
case (the smallest step, so the largest relative cost). Figures per model and batch:
- tokens/s off and on: medians over `repeats` runs that alternate off, on, off, on, ...
  (each run: `batch` requests submitted together, `max-tokens` tokens each);
- overhead = 1 - the median of the paired ratios on/off (each pair run back to back,
  order alternating): noisy on a shared machine, where runs vary by +-15 %;
- in_metrics = time spent inside the metrics objects' calls / wall time of the "on" runs,
  timed directly (the low-noise figure of what recording costs the engine threads).
The gRPC call interceptor and the draft pool's round-trip hook are not in this loop: they
add a few counter increments per gRPC message (microseconds against rounds of
milliseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from chainspec.engine.draft_client import LocalDraftClient  # noqa: E402
from chainspec.engine.drafter import DrafterConfig, DrafterEngine  # noqa: E402
from chainspec.engine.local import LocalOptions, load_models  # noqa: E402
from chainspec.engine.request import StopConditions  # noqa: E402
from chainspec.engine.runner import run_to_completion  # noqa: E402
from chainspec.engine.sampling import SamplingParams  # noqa: E402
from chainspec.engine.verifier import VerifierConfig, VerifierEngine  # noqa: E402
from chainspec.metrics.drafter import DrafterMetrics  # noqa: E402
from chainspec.metrics.verifier import VerifierMetrics  # noqa: E402
from tests.integration.tiny_checkpoint import write_tiny_model  # noqa: E402

K, MAX_LEN = 3, 512
HOOKS = ("request_added", "step_done", "update_done", "occupancy")


class TimedObserver:
    """Forwards the observer calls to `inner`, adding up the time spent in them."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, 0.0
        for name in HOOKS:
            if hasattr(inner, name):
                setattr(self, name, self._timed(getattr(inner, name)))

    def _timed(self, method):
        def timed(*args):
            t0 = time.perf_counter()
            method(*args)
            self.seconds += time.perf_counter() - t0
        return timed


def build(models, batch: int, observed: bool):
    verifier_obs = TimedObserver(VerifierMetrics("bench", K)) if observed else None
    drafter_obs = TimedObserver(DrafterMetrics("bench", K)) if observed else None
    drafter = DrafterEngine(models.draft, DrafterConfig(num_steps=K, max_seqs=batch,
                                                        max_len=MAX_LEN), observer=drafter_obs)
    config = VerifierConfig(num_steps=K, max_seqs=batch, max_len=MAX_LEN,
                            max_batch_tokens=max(1024, batch * (K + 1)))
    engine = VerifierEngine(models.target, config, LocalDraftClient(drafter),
                            observer=verifier_obs)
    return engine, [o for o in (verifier_obs, drafter_obs) if o is not None]


def prompts(batch: int) -> list[list[int]]:
    base = [[5, 17, 33, 2, 9], [40, 41, 42], [7] * 12, list(range(3, 30)), [11, 13, 17, 19],
            [60, 2, 60, 2, 60], [23, 5], [99, 98, 97, 96, 95, 94]]
    return [base[i % len(base)] for i in range(batch)]


def measure(models, batch: int, max_tokens: int, repeats: int) -> dict:
    engines = {"off": build(models, batch, False), "on": build(models, batch, True)}
    stop = StopConditions(max_tokens=max_tokens, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0)
    for engine, _ in engines.values():  # warm-up, outputs compared once
        run_to_completion(engine, prompts(batch), greedy, stop)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    on_wall = 0.0
    for r in range(repeats):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # ABBA: no order bias
            engine, _ = engines[mode]
            result = run_to_completion(engine, prompts(batch), greedy, stop)
            rates[mode].append(result.generated_tokens / result.seconds)
            if mode == "on":
                on_wall += result.seconds
    in_metrics = sum(o.seconds for o in engines["on"][1])
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    return {"batch": batch, "tok_s_off": round(statistics.median(rates["off"]), 1),
            "tok_s_on": round(statistics.median(rates["on"]), 1),
            "overhead": round(1 - statistics.median(ratios), 4),
            "in_metrics_share": round(in_metrics / on_wall, 5),
            "runs_off": [round(r, 1) for r in rates["off"]],
            "runs_on": [round(r, 1) for r in rates["on"]]}


def default_models(tmp: Path) -> dict[str, Path]:
    return {"demo-shape (hidden 192, 14 layers)":
            write_tiny_model(tmp / "demo-shape", hidden=192, layers=14, mix=0.1),
            "tiny (hidden 32, 2 layers)": write_tiny_model(tmp / "tiny")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: synthetic ones)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=16)
    p.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {args.model.name: args.model} if args.model else default_models(Path(tmp))
        for name, path in models.items():
            loaded = load_models(LocalOptions(path, num_steps=K, max_seqs=max(args.batch),
                                              max_len=MAX_LEN))
            for batch in args.batch:
                row = {"model": name, **measure(loaded, batch, args.max_tokens, args.repeats)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    report(rows, args)


def report(rows: list[dict], args) -> None:
    env = (f"{platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
           f"torch {torch.__version__}; torch threads 1; K={K}; {args.max_tokens} tokens per "
           f"request; greedy; {args.repeats} interleaved run pairs (ABBA); load "
           f"average at the end {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(env)
    if args.out is None:
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=2)
                                             + "\n")
    lines = [f"# metrics_overhead\n\n{env}.\n",
             "| model | batch | tok/s off (median) | tok/s on (median) | overhead (1 - median "
             "paired on/off) | time in metrics calls / wall |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['batch']} | {r['tok_s_off']} | {r['tok_s_on']} | "
              f"{100 * r['overhead']:.1f} % | {100 * r['in_metrics_share']:.2f} % |"
              for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""`chainspec bench serve`: load-test any OpenAI-compatible endpoint over a sweep of load
points (fixed concurrency and/or Poisson request rates), as `vllm bench serve` does.

Per point: TTFT, TPOT, ITL and e2e (mean, p50/p90/p99), request and token throughput,
goodput under --goodput SLOs, and errors; against a chainspec stack also the acceptance
length and per-position acceptance from the verifiers' /metrics over the point, and the
drafter count over time. --compare-plain reruns the sweep with the stack's drafters
scaled to 0 (`chainspec scale`, so --stack-address/--stack-namespace must name the stack
as for `chainspec status`) and scales them back. Writes serve.json, serve.md and PNG plots
under --out.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from chainspec.spine.sections import DEMO_MODEL

DATASETS = ("heldout", "random", "jsonl")


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") \
            from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, http(s)://HOST:PORT without /v1")
    p.add_argument("--model-name", help="model to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="bearer key (default: $CHAINSPEC_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--concurrency", type=_floats, default=[],
                   help="fixed-concurrency load points, e.g. 1,2,4,8 (default: none; give "
                        "this, --request-rate or both)")
    p.add_argument("--request-rate", type=_floats, default=[],
                   help="Poisson arrival rates (requests/s) as load points, e.g. 0.5,1,2 "
                        "(default: none)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per load point")
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests before a sweep")
    p.add_argument("--dataset", choices=DATASETS, default="heldout",
                   help="heldout: the model directory's heldout_prompts.json; random: "
                        "random token ids; jsonl: --dataset-path, {\"prompt\", "
                        "\"max_tokens\"?} a line")
    p.add_argument("--dataset-path", type=Path,
                   help="the JSONL file (--dataset jsonl; default: none)")
    p.add_argument("--model-dir", type=Path, default=DEMO_MODEL,
                   help="for held-out prompts and the random vocabulary (default: the "
                        "bundled demo model)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (ignore_eos)")
    p.add_argument("--random-input-len", type=int, default=32, help="--dataset random")
    p.add_argument("--random-output-len", type=int, default=64, help="--dataset random")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in len * [1 - r, 1 + r]")
    p.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2e:5000 (default: none, "
                        "no goodput)")
    p.add_argument("--compare-plain", action="store_true",
                   help="rerun the sweep with drafters scaled to 0, then restore them")
    p.add_argument("--idle-tail", type=float, default=0.0, metavar="SECONDS",
                   help="keep recording the drafter count this long after the last point "
                        "(autoscaling's scale-in)")
    p.add_argument("--stack-address", help="Ray address of the stack, for scaling (default: "
                                           "the namespace's state file)")
    p.add_argument("--stack-namespace", help="namespace of the stack, for scaling "
                                             "(default: chainspec)")
    p.add_argument("--seed", type=int, default=0, help="Poisson arrivals, random prompts")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serve"),
                   help="folder for serve.json, serve.md and the plots")
    p.add_argument("--no-plots", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Check every argument and the endpoint (and the stack, for scaling), then sweep;
    serve.json and serve.md are written whatever the points did."""
    try:
        from chainspec.benchserve import report, sweep
        if not args.no_plots:
            import matplotlib  # noqa: F401 (fail before the sweep, not after it)
    except ModuleNotFoundError as e:  # httpx: an extra, not a serving dependency
        raise ValueError(f"bench serve needs {e.name}: pip install 'chainspec[bench]'") \
            from None
    cfg = _config(args)
    data = _dataset(args)
    _check_out(args.out)
    control = sweep.StackControl(tuple(
        a for flag, v in (("--address", args.stack_address),
                          ("--namespace", args.stack_namespace)) if v for a in (flag, v)))
    result = sweep.run(cfg, data, args.compare_plain, control)
    full = {"command": _command(), "base_url": cfg.base_url, "dataset": data.name,
            "requests_per_point": cfg.requests_per_point, "slo": cfg.slo.as_dict(),
            "seed": cfg.seed, **result, "plots": []}
    paths = report.write(full, args.out)  # NOTE: before the plots, which may fail
    problems = [f"the sweep stopped early (its finished points are in {paths[0]}): "
                f"{result['error']}"] if result["error"] else []
    if not args.no_plots:
        pngs, plot_error = _plots(full, args.out)
        if plot_error:
            problems.append(plot_error)
        full["plots"] = [p.name for p in pngs]
        paths = report.write(full, args.out) + pngs
    print(report.markdown(full))
    print("wrote " + ", ".join(map(str, paths)))
    for problem in problems:
        print(f"chainspec bench serve: {problem}", file=sys.stderr)
    failed = any(p["errors"] for ps in full["runs"].values() for p in ps)
    return 1 if failed or problems else 0


def _config(args: argparse.Namespace):
    """The sweep's settings, validated (ValueError names the flag)."""
    from chainspec.benchserve.config import SLO, LoadKind, LoadPoint, SweepConfig

    points = tuple([LoadPoint(LoadKind.CONCURRENCY, c) for c in args.concurrency]
                   + [LoadPoint(LoadKind.RATE, r) for r in args.request_rate])
    api_key = args.api_key or os.environ.get("CHAINSPEC_API_KEY") \
        or os.environ.get("OPENAI_API_KEY")
    return SweepConfig(args.base_url.rstrip("/"), points, args.num_prompts, args.model_name,
                       api_key, SLO.parse(args.goodput), args.seed, args.timeout, args.warmup,
                       args.idle_tail)


def _check_out(out: Path) -> None:
    """--out exists (made if need be) and takes files, before any load is sent."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there: {e.strerror or e}") from None


def _plots(full: dict, out: Path) -> tuple[list[Path], str | None]:
    """The PNGs, or those written before one failed and why (the figures stay written)."""
    from chainspec.benchserve import plots

    try:
        return plots.write_all(full, out), None
    except Exception as e:  # noqa: BLE001 (a plot is a view: never lose the numbers to it)
        return [], f"plots not written: {type(e).__name__}: {' '.join(str(e).split())}"


def _dataset(args: argparse.Namespace):
    from chainspec.benchserve import dataset

    if args.dataset_path is not None and args.dataset != "jsonl":
        raise ValueError(f"--dataset-path is read with --dataset jsonl, not {args.dataset}")
    if args.dataset == "heldout":
        return dataset.heldout(args.model_dir, args.output_len)
    if args.dataset == "jsonl":
        if args.dataset_path is None:
            raise ValueError("--dataset jsonl needs --dataset-path")
        return dataset.jsonl(args.dataset_path, args.output_len)
    from chainspec.models.tokenizer import Tokenizer
    vocab = Tokenizer.from_dir(args.model_dir).vocab_size
    return dataset.random_tokens(vocab, args.random_input_len, args.random_output_len,
                                 args.random_range_ratio, args.num_prompts, args.seed)


def _command() -> str:
    argv = sys.argv[1:]
    if argv[:2] != ["bench", "serve"]:
        return "(called in-process)"
    return "chainspec " + shlex.join(argv)

"""One second of a batch-8 run over gRPC, drawn on one time axis: the verifier's forward
per group, its wait for drafts, the drafter's compute (exact rounds and look-aheads) and
the wire both ways, without pipelining (1 group), with 2 pipelined groups, and with one
group and multi-hypothesis draft-ahead (DESIGN 4.8).

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/pipeline_timeline.py \
        [--batch 8] [--max-tokens 128] [--pin] \
        [--out benchmarks/results/pipeline_timeline.png]

`--pin`: this process (the verifier) on core 0, the drafter process on core 1
(`os.sched_setaffinity` on every thread) at nice `--pin-nice` (-10), as
`services_bench.py --pin` places them.

The verifier engine runs here, the drafter in its own process (`round_breakdown`'s traced
drafter server); both stamp CLOCK_MONOTONIC (`time.monotonic_ns`, which `perf_counter`
also reads on Linux), so their marks share one axis. Greedy outputs are checked against
plain decoding. Also writes the figures next to the PNG as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import torch

from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.observer import VerifierStepRecord
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.verifier import VerifierConfig, VerifierEngine
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.draft_pool import GrpcDraftClient
from chainspec.rpc.round_trace import RoundTrace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_breakdown import PROMPTS, drafter_process  # noqa: E402

WINDOW_S = 1.0
COLORS = ("tab:blue", "tab:orange", "tab:green")


class StepLog:
    """A verifier observer keeping (group, started, drafts in, finished) per step, in ns."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int, int]] = []

    def request_added(self, *args) -> None:
        pass

    def step_done(self, step: VerifierStepRecord) -> None:
        if step.work:
            group = step.work[0].request.group
            self.steps.append((group, *(int(t * 1e9) for t in (
                step.started_s, step.drafts_s, step.finished_s))))


def pin(pid: int, cores: set[int], nice: int = 0) -> None:
    """Every thread of process `pid` on `cores`, at priority `nice` (services_bench)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            if nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:  # NOTE: a thread that ended meanwhile
            pass


def run(models, opts: LocalOptions, prompts, max_tokens: int, groups: int, port: int,
        conn, ahead: bool = False) -> dict:
    client = GrpcDraftClient(max_seqs=len(prompts), round_deadline_s=1.0)
    client.trace = RoundTrace()
    client.set_endpoints([f"127.0.0.1:{port}"])
    client.wait_connected(30)
    log = StepLog()
    config = VerifierConfig(num_steps=opts.num_steps, max_seqs=len(prompts),
                            max_len=opts.max_len, groups=groups, draft_ahead=ahead)
    engine = VerifierEngine(models.target, config, client, observer=log)
    conn.send("trace")
    conn.recv()  # drop the drafter's earlier marks
    result = run_to_completion(engine, prompts, SamplingParams(temperature=0.0),
                               StopConditions(max_tokens=max_tokens, ignore_eos=True))
    conn.send("trace")
    drafter_marks = conn.recv()
    client.close()
    tokens = [c.tokens for c in result.completions]
    return {"tokens": tokens, "steps": log.steps, "verifier_marks": client.trace.drain(),
            "drafter_marks": drafter_marks, "groups": groups, "ahead": ahead,
            "ahead_hits": engine.ahead_hits, "ahead_misses": engine.ahead_misses,
            "ahead_rank_hits": {str(r): n for r, n in sorted(engine.ahead_rank_hits.items())},
            "label": f"{groups} group(s)" + (", draft-ahead" if ahead else "")}


def spans(r: dict) -> dict[str, list[tuple[int, int, int]]]:
    """Per lane: (start_ns, end_ns, group) spans."""
    marks: dict[int, dict[str, int]] = {}
    recv: dict[int, list[int]] = {}
    for batch_id, hop, t in [*r["verifier_marks"], *r["drafter_marks"]]:
        marks.setdefault(batch_id, {}).setdefault(hop, t)
        if hop == "v_recv":
            recv.setdefault(batch_id, []).append(t)
    for batch_id, m in marks.items():  # NOTE: the exact answer's, not an early look-ahead's
        if "d_send" in m:
            m["v_recv"] = min((t for t in recv.get(batch_id, ()) if t >= m["d_send"]),
                              default=m.get("v_recv", m["d_send"]))
    out: dict[str, list] = {"verifier forward": [], "verifier waits for drafts": [],
                            "wire": [], "drafter compute": [], "drafter look-ahead": []}
    for group, started, drafts_in, finished in r["steps"]:
        out["verifier waits for drafts"].append((started, drafts_in, group))
        out["verifier forward"].append((drafts_in, finished, group))
    ends = sorted((finished, group) for group, _, _, finished in r["steps"])
    for m in marks.values():
        if not {"v_send", "d_recv", "d_start", "d_drafted", "d_send", "v_recv"} <= m.keys():
            continue
        # NOTE: a batch leaves at the end of the step that made it: that step's group
        group = next((g for end, g in ends if end >= m["v_send"]), 0)
        out["wire"].append((m["v_send"], m["d_recv"], group))
        out["drafter compute"].append((m["d_start"], m["d_drafted"], group))
        out["wire"].append((m["d_send"], m["v_recv"], group))
        if {"d_ahead_start", "d_ahead_end"} <= m.keys():
            out["drafter look-ahead"].append((m["d_ahead_start"], m["d_ahead_end"], group))
    return out


def figures(r: dict, lanes: dict) -> dict:
    """Shares of the run's wall time (from the first to the last step)."""
    t0, t1 = r["steps"][0][1], r["steps"][-1][3]

    def busy(lane: str) -> float:
        return sum(e - s for s, e, _ in lanes[lane]) / (t1 - t0)
    looked = r["ahead_hits"] + r["ahead_misses"]
    return {"mode": r["label"], "groups": r["groups"], "wall_s": (t1 - t0) / 1e9,
            "ahead_hit_rate": r["ahead_hits"] / looked if looked else None,
            "ahead_rank_hits": r["ahead_rank_hits"],
            "drafter_look_ahead_share": busy("drafter look-ahead"),
            "tokens": sum(map(len, r["tokens"])),
            "tokens_per_s": sum(map(len, r["tokens"])) / ((t1 - t0) / 1e9),
            "verifier_forward_share": busy("verifier forward"),
            "verifier_wait_share": busy("verifier waits for drafts"),
            "drafter_compute_share": busy("drafter compute")}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.6 * len(runs)), sharex=True)
    for ax, r in zip(axes, runs, strict=True):
        lanes = spans(r)
        mid = r["steps"][len(r["steps"]) // 3][1]  # steady state, past prefill
        lo, hi = mid, mid + int(WINDOW_S * 1e9)
        names = list(lanes)
        for row, name in enumerate(names):
            bars = [((s - lo) / 1e6, (e - s) / 1e6) for s, e, g in lanes[name]
                    if e > lo and s < hi]
            colors = [COLORS[g % len(COLORS)] for s, e, g in lanes[name] if e > lo and s < hi]
            ax.broken_barh(bars, (row - 0.35, 0.7), facecolors=colors)
        ax.set_yticks(range(len(names)), names)
        ax.set_xlim(0, WINDOW_S * 1e3)
        f = figures(r, lanes)
        hits = "" if f["ahead_hit_rate"] is None else \
            f"; look-ahead hits {100 * f['ahead_hit_rate']:.0f} %"
        ax.set_title(f"{r['label']}: {f['tokens_per_s']:.0f} tokens/s; verifier "
                     f"waits {100 * f['verifier_wait_share']:.0f} % of the time{hits} "
                     f"(colour = group)", fontsize=10)
    axes[-1].set_xlabel("ms (one second of a batch-8 greedy run, demo model, K = 3)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/pipeline_timeline.png")
    p.add_argument("--pin", action="store_true", help="verifier on core 0, drafter on 1")
    p.add_argument("--pin-nice", type=int, default=-10,
                   help="with --pin: both processes' priority (0: unchanged)")
    args = p.parse_args(argv)
    if args.pin:
        pin(os.getpid(), {0}, args.pin_nice)
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(DEMO_MODEL)
    prompts = [tok.encode(t) for t in (PROMPTS * args.batch)[:args.batch]]
    opts = LocalOptions(model_dir=DEMO_MODEL, num_steps=args.k, max_seqs=args.batch,
                        max_len=512)
    models = load_models(opts)
    plain = [c.tokens for c in run_to_completion(
        build_verifier(models, opts, speculative=False), prompts,
        SamplingParams(temperature=0.0),
        StopConditions(max_tokens=args.max_tokens, ignore_eos=True)).completions]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=drafter_process, daemon=True,
                       args=(child, str(DEMO_MODEL), args.k, args.batch, 512, 1))
    proc.start()
    port = conn.recv()
    if args.pin:
        pin(proc.pid, {1}, args.pin_nice)
    try:
        runs = [run(models, opts, prompts, args.max_tokens, g, port, conn, ahead)
                for g, ahead in ((1, False), (2, False), (1, True))]
    finally:
        conn.send("stop")
        proc.join(10)
    for r in runs:
        assert r["tokens"] == plain, f"{r['label']}: output differs from plain"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, out)
    report = [figures(r, spans(r)) for r in runs]
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

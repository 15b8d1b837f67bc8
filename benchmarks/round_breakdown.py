"""Where a gRPC draft round's time goes, hop by hop (issue 11, item 4).

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/round_breakdown.py \
        [--model DIR] [--batch 1 8] [--repeats 3] [--out benchmarks/results/round_breakdown]
    .venv/bin/python benchmarks/round_breakdown.py --table A.json [B.json ...] [--labels ...]

1. Capture: run the verifier with an in-process drafter on the demo model and keep every
   batch of updates it sends (and the in-process drafts, round time and drafter time).
2. Replay: a drafter server (`DrafterServicer`, its own process, as in a deployment)
   and a `GrpcDraftClient` here; each captured round is `submit` then `collect`, with
   `--gap-ms` between rounds where the verifier would run its forward: busy with torch
   matmuls on the verifier's thread as a forward is (`--idle-gap`: asleep). Drafts
   must equal the in-process ones (checked).
3. Both sides record `RoundTrace` marks (`time.monotonic_ns()`, one clock for both
   processes on Linux) per batch id; the table gives the median of each hop over the
   rounds that wanted drafts.

wire = round trip (submit .. collect returns) - the drafter engine's update; the share
is wire over an estimated gRPC round = in-process round - in-process drafter compute +
round trip. The floor beside it: a bare gRPC echo of the same byte sizes through the same
server shell and client threading. `breakdown(...)` returns the rows, `table(...)` the
markdown, for other benchmarks (services_bench). Results: benchmarks/results/round_breakdown.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import torch

from chainspec.engine.draft_types import DraftReply, DraftResult, UpdateBatch
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.draft_codec import encode_draft_request, encode_draft_response
from chainspec.rpc.draft_pool import GrpcDraftClient
from chainspec.rpc.round_trace import RoundTrace

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def ",
           "for i in range(10):\n", "def main():\n    parser = ", "# Read a file\nwith open(",
           "if __name__ == \"__main__\":\n", "def quicksort(items):\n"]
# (name, from mark, to mark); "submit" and "collected" are marked by this script
HOPS = [
    ("submit: route + lock", "submit", "v_send"),
    ("verifier encode", "v_send", "v_encoded"),
    ("queue -> grpc send thread", "v_encoded", "v_pulled"),
    ("request: serialize, transfer, parse, loop", "v_pulled", "d_recv"),
    ("drafter loop -> worker", "d_recv", "d_start"),
    ("drafter decode", "d_start", "d_decoded"),
    ("drafter engine update", "d_decoded", "d_drafted"),
    ("drafter encode", "d_drafted", "d_encoded"),
    ("drafter worker -> loop -> send", "d_encoded", "d_send"),
    ("response: serialize, transfer, parse", "d_send", "v_recv"),
    ("verifier decode", "v_recv", "v_decoded"),
    ("reply + wake engine thread", "v_decoded", "collected"),
]


# ---------------------------------------------------------------------------- capture


class CapturingClient:
    """In-process draft client that keeps every submitted batch and its outcomes."""

    def __init__(self, engine: DrafterEngine) -> None:
        self.engine = engine
        self.rounds: list[tuple[list, list]] = []
        self.seconds = 0.0
        self._ready: dict = {}

    def submit(self, updates) -> None:
        t0 = time.perf_counter()
        outcomes = self.engine.update(updates)
        self.seconds += time.perf_counter() - t0
        # NOTE: hidden rows may be views of the verifier's step buffers: keep copies
        self.rounds.append(([replace(u, hidden=u.hidden.clone()) for u in updates],
                            list(outcomes)))
        self._ready.update((u.seq_id, o) for u, o in zip(updates, outcomes, strict=True))

    def collect(self, wait_for=None):
        ready, self._ready = self._ready, {}
        return ready

    def release(self, seq_ids) -> None:
        self.engine.release(seq_ids)


def capture(models, opts: LocalOptions, prompts, max_tokens: int) -> dict:
    engine = build_verifier(models, opts, speculative=True)
    engine.drafter = CapturingClient(engine.drafter.engine)
    stop = StopConditions(max_tokens=max_tokens, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0)
    run_to_completion(engine, prompts[:1], greedy, StopConditions(max_tokens=8, ignore_eos=True))
    engine.drafter.rounds, engine.drafter.seconds = [], 0.0
    result = run_to_completion(engine, prompts, greedy, stop)
    client = engine.drafter
    return {"rounds": client.rounds, "local_round_ms": 1e3 * result.seconds / result.steps,
            "local_drafter_ms": 1e3 * client.seconds / max(len(client.rounds), 1)}


# ------------------------------------------------------------------ drafter process


async def _echo(requests, context):
    """Answers each message with its first 4 bytes' count of bytes: a bare round trip."""
    async for raw in requests:
        yield raw[:int.from_bytes(raw[:4], "little")]

ECHO_HANDLER = grpc.method_handlers_generic_handler(
    "bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(_echo)})


def drafter_process(conn, model_dir: str, k: int, max_seqs: int, max_len: int,
                    threads: int) -> None:
    """A drafter server with tracing on; answers "trace" and "stop" on `conn`."""
    torch.set_num_threads(threads)
    asyncio.run(_serve(conn, model_dir, k, max_seqs, max_len))


async def _serve(conn, model_dir: str, k: int, max_seqs: int, max_len: int) -> None:
    from chainspec.rpc.drafter_service import DRAFTER_SERVICE, DrafterServicer
    from chainspec.rpc.server import ServerOptions, start_server
    opts = LocalOptions(model_dir=Path(model_dir), num_steps=k, max_seqs=max_seqs,
                        max_len=max_len)
    draft = load_models(opts).draft
    engine = DrafterEngine(draft, DrafterConfig(num_steps=k, max_seqs=max_seqs,
                                                max_len=max_len))
    servicer = DrafterServicer(engine, "demo")
    servicer.trace = RoundTrace()

    def register(server) -> None:
        servicer.register(server)
        server.add_generic_rpc_handlers((ECHO_HANDLER,))
    running = await start_server(ServerOptions(), register, [DRAFTER_SERVICE])
    await servicer.warm_up()
    await running.set_serving(True)
    loop = asyncio.get_running_loop()
    conn.send(running.port)
    while (cmd := await loop.run_in_executor(None, conn.recv)) != "stop":
        conn.send(servicer.trace.drain() if cmd == "trace" else None)
    await running.stop(0)
    servicer.close()


# --------------------------------------------------------------------------- replay


def busy(seconds: float, x: torch.Tensor) -> None:
    """Keep this thread in torch for `seconds`, as the verifier's forward keeps it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = torch.tanh(x @ x)


def replay(client: GrpcDraftClient, rounds, gap_s: float,
           idle: bool = False) -> tuple[list[dict], int]:
    """Submit each captured round and collect it; per round: batch id, marks, engine s."""
    out, mismatches = [], 0
    trace = client.trace
    for updates, outcomes in rounds:
        wants = any(u.want_drafts for u in updates)
        trace.mark(-1, "submit")
        client.submit(updates)
        got = client.collect()
        trace.mark(-1, "collected")
        for u, o in zip(updates, outcomes, strict=True):
            r = got.get(u.seq_id)
            if u.want_drafts and isinstance(o, DraftResult) and not (
                    isinstance(r, DraftResult) and torch.equal(r.tokens, o.tokens)
                    and r.position == o.position):
                mismatches += 1
        engine_s = [r.draft_time_s for r in got.values() if isinstance(r, DraftResult)]
        out.append({"wants": wants, "engine_s": engine_s[0] if engine_s else None})
        if not wants:
            time.sleep(0.05)  # no-draft batches: let them land
        elif idle:
            time.sleep(gap_s)
        else:
            busy(gap_s, torch.randn(64, 64) / 8)
    client.release(sorted({u.seq_id for ups, _ in rounds for u in ups}))
    time.sleep(0.05)
    return out, mismatches


def echo_floor(port: int, rounds, gap_s: float, idle: bool) -> float:
    """Median round trip (ms) of bare messages of each round's request and reply sizes
    through the same server shell and the pool's threading (queue -> grpc's send
    thread, a reader thread, a wake-up): what any round pays before any codec."""
    sizes = []
    for updates, outcomes in rounds:
        if any(u.want_drafts for u in updates):
            req = encode_draft_request(UpdateBatch(1, tuple(updates))).ByteSize()
            resp = encode_draft_response(DraftReply(1, tuple(outcomes))).ByteSize()
            sizes.append((req, resp))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    requests: queue.SimpleQueue = queue.SimpleQueue()
    answers: queue.SimpleQueue = queue.SimpleQueue()
    responses = channel.stream_stream("/bench.Echo/Echo")(iter(requests.get, None))
    threading.Thread(target=lambda: [answers.put(time.monotonic_ns()) for _ in responses],
                     daemon=True).start()
    trips = []
    for req, resp in sizes:
        t0 = time.monotonic_ns()
        requests.put(max(resp, 4).to_bytes(4, "little") + bytes(max(req - 4, 0)))
        trips.append((answers.get() - t0) / 1e6)
        if idle:
            time.sleep(gap_s)
        else:
            busy(gap_s, torch.randn(64, 64) / 8)
    requests.put(None)
    channel.close()
    return statistics.median(trips)


def attach(marks_v, marks_d, rounds: list[dict]) -> list[dict]:
    """Per round, every mark's time (ns); the script's own marks carry batch id -1."""
    by_batch: dict[int, dict[str, int]] = {}
    for batch_id, hop, t in [*marks_v, *marks_d]:
        if batch_id >= 0:
            by_batch.setdefault(batch_id, {})[hop] = t
    own = [(hop, t) for batch_id, hop, t in marks_v if batch_id < 0]
    sends = sorted(b for b, hops in by_batch.items() if "v_send" in hops)
    i = 0
    for r, ((_, t_submit), (_, t_collected)) in zip(rounds, zip(own[::2], own[1::2],
                                                                 strict=True), strict=True):
        while i < len(sends) and by_batch[sends[i]]["v_send"] < t_submit:
            i += 1  # release-only batches
        r["marks"] = dict(by_batch.get(sends[i], {}) if i < len(sends) else {},
                          submit=t_submit, collected=t_collected)
        i += 1
    return rounds


def summarize(rounds: list[dict], captured: dict) -> dict:
    rows = [r for r in rounds if r["wants"] and r["engine_s"] is not None]
    hops = {}
    for name, a, b in HOPS:
        vals = [(r["marks"][b] - r["marks"][a]) / 1e6 for r in rows
                if a in r["marks"] and b in r["marks"]]
        hops[name] = statistics.median(vals) if vals else float("nan")
    trip = [(r["marks"]["collected"] - r["marks"]["submit"]) / 1e6 for r in rows]
    engine = [1e3 * r["engine_s"] for r in rows]
    wire = [t - e for t, e in zip(trip, engine, strict=True)]
    round_ms = captured["local_round_ms"] - captured["local_drafter_ms"] + statistics.median(trip)
    return {"rounds": len(rows), "hops_ms": hops, "round_trip_ms": statistics.median(trip),
            "engine_ms": statistics.median(engine), "wire_ms": statistics.median(wire),
            "local_round_ms": captured["local_round_ms"],
            "local_drafter_ms": captured["local_drafter_ms"],
            "est_grpc_round_ms": round_ms, "wire_share": statistics.median(wire) / round_ms}


def breakdown(model: Path, batches, k: int = 3, max_tokens: int = 64, max_len: int = 512,
              repeats: int = 3, gap_ms: float = 10.0, threads: int = 1,
              idle_gap: bool = False) -> list[dict]:
    """One row per batch size: median hop times over `repeats` replays of a captured run."""
    tok = Tokenizer.from_dir(model)
    prompts = [tok.encode(t) for t in PROMPTS]
    max_seqs = max(batches)
    opts = LocalOptions(model_dir=model, num_steps=k, max_seqs=max_seqs, max_len=max_len)
    models = load_models(opts)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=drafter_process, daemon=True,
                       args=(child_conn, str(model), k, max_seqs, max_len, threads))
    proc.start()
    port = conn.recv()
    # NOTE: a long deadline: every round is timed to its answer, none is dropped late
    client = GrpcDraftClient(max_seqs=max_seqs, round_deadline_s=10.0)
    client.trace = RoundTrace()  # before connecting: the stream's requests are marked too
    client.set_endpoints([f"127.0.0.1:{port}"])
    client.wait_connected(30)
    rows = []
    try:
        for batch in batches:
            captured = capture(models, opts, (prompts * batch)[:batch], max_tokens)
            rounds, mismatches = [], 0
            for _ in range(repeats):
                client.trace.drain()
                conn.send("trace")
                conn.recv()
                got, bad = replay(client, captured["rounds"], gap_ms / 1e3, idle_gap)
                conn.send("trace")
                rounds += attach(client.trace.drain(), conn.recv(), got)
                mismatches += bad
            echo = statistics.median(echo_floor(port, captured["rounds"], gap_ms / 1e3,
                                                idle_gap) for _ in range(repeats))
            rows.append({"batch": batch, "draft_mismatches": mismatches, "echo_ms": echo,
                         **summarize(rounds, captured)})
            print(json.dumps(rows[-1], indent=1), flush=True)
    finally:
        client.close()
        conn.send("stop")
        proc.join(10)
    return rows


# ---------------------------------------------------------------------------- report


def table(runs: list[dict], labels: list[str]) -> str:
    """Markdown: one column per (label, batch), hops in rows; runs with the same label are
    merged by the median of each figure. The share's round is the same for every label:
    the median over all runs of (in-process round - in-process drafter) + round trip."""
    merged: dict[tuple[str, int], list[dict]] = {}
    base: dict[int, list[float]] = {}
    for label, run in zip(labels, runs, strict=True):
        for row in run["rows"]:
            merged.setdefault((label, row["batch"]), []).append(row)
            base.setdefault(row["batch"], []).append(row["local_round_ms"] -
                                                     row["local_drafter_ms"])
    cols = [(f"{label} b{batch}", _merge(rows, statistics.median(base[batch])))
            for (label, batch), rows in merged.items()]
    lines = ["| hop (median ms) | " + " | ".join(c for c, _ in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for name, _, _ in HOPS:
        lines.append(f"| {name} | " + " | ".join(f"{m['hops_ms'][name]:.3f}"
                                                for _, m in cols) + " |")
    for key, name in [("round_trip_ms", "**round trip** (submit .. collect)"),
                      ("echo_ms", "bare gRPC echo, same sizes and threads (floor)"),
                      ("engine_ms", "drafter engine (draft_time_s)"),
                      ("wire_ms", "**wire** = round trip - engine"),
                      ("est_grpc_round_ms", "est. gRPC round"),
                      ("wire_share", "**wire share**")]:
        fmt = (lambda v: f"{100 * v:.1f} %") if key == "wire_share" else (lambda v: f"{v:.2f}")
        lines.append(f"| {name} | " + " | ".join(fmt(m[key]) for _, m in cols) + " |")
    lines.append("| rounds measured / draft mismatches | " + " | ".join(
        f"{m['rounds']} / {m['draft_mismatches']}" for _, m in cols) + " |")
    return "\n".join(lines) + "\n"


def _merge(rows: list[dict], base_ms: float) -> dict:
    med = {k: statistics.median(r.get(k, math.nan) for r in rows)
           for k in ("round_trip_ms", "engine_ms", "wire_ms", "echo_ms")}
    med["hops_ms"] = {name: statistics.median(r["hops_ms"][name] for r in rows)
                      for name, _, _ in HOPS}
    med["est_grpc_round_ms"] = base_ms + med["round_trip_ms"]
    med["wire_share"] = med["wire_ms"] / med["est_grpc_round_ms"]
    med["rounds"] = sum(r["rounds"] for r in rows)
    med["draft_mismatches"] = sum(r["draft_mismatches"] for r in rows)
    return med


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEMO_MODEL)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="replays per batch size")
    p.add_argument("--gap-ms", type=float, default=10.0, help="verifier work between rounds")
    p.add_argument("--idle-gap", action="store_true", help="sleep between rounds instead")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", type=Path, default=None, help="write OUT.json")
    p.add_argument("--table", type=Path, nargs="+", default=None,
                   help="print a markdown table of these JSON outputs instead")
    p.add_argument("--labels", nargs="+", default=None)
    args = p.parse_args(argv)
    if args.table:
        runs = [json.loads(f.read_text()) for f in args.table]
        print(table(runs, args.labels or [f.stem for f in args.table]))
        return 0
    torch.set_num_threads(args.threads)
    rows = breakdown(args.model, args.batch, args.k, args.max_tokens, args.max_len,
                     args.repeats, args.gap_ms, args.threads, args.idle_gap)
    meta = {"model": str(args.model), "k": args.k, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "gap_ms": args.gap_ms, "idle_gap": args.idle_gap,
            "load_average": os.getloadavg(),
            "host": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"}
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(table([{"rows": rows}], ["run"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

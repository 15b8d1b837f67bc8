"""Soak test: `chainspec serve` on the demo model under N concurrent streams for a fixed
time (bounded; loopback only), every answer checked against plain greedy decoding, and
the resident memory of every process of the stack sampled throughout.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/soak.py \
        [--duration 600] [--streams 64] [--max-tokens 32] [--out benchmarks/results/soak]

The stack runs in its own state directory and namespace with an embedded Ray owned by the
`serve` process, so it touches no other stack on the machine and is stopped at the end.
Requests alternate streamed and whole completions (greedy, ignore_eos, held-out prompts).
Pass criteria: 0 errors, every output equal to plain, and for every process RSS growth
under 5 % from the end of warm-up (the first `--warmup` seconds) to the end, measured as
the mean of the last three samples over the mean of the first three after warm-up.
Writes soak.json, soak.md and soak_rss.png (RSS of each process over time) under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer

GROWTH_LIMIT = 0.05


@dataclass
class Tally:
    requests: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prompts = json.loads((Path(DEMO_MODEL) / "heldout_prompts.json").read_text())
    prompts = prompts[:args.prompts]
    print(f"plain greedy reference for {len(prompts)} held-out prompts ...", flush=True)
    expected = plain_texts(prompts, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="chainspec-soak-") as state:
        proc, url = start_serve(state, args)
        try:
            result = asyncio.run(soak(url, proc.pid, prompts, expected, args))
        finally:
            stop_serve(proc)
    report = summarize(result, args)
    write(report, result["samples"], Path(args.out))
    print(json.dumps({k: v for k, v in report.items() if k != "processes"}, indent=2))
    return 0 if report["passed"] else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=120.0, help="seconds before RSS baseline")
    p.add_argument("--streams", type=int, default=64, help="concurrent client streams")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts to cycle")
    p.add_argument("--sample-every", type=float, default=15.0, help="RSS sample period, s")
    p.add_argument("--out", default="benchmarks/results/soak")
    return p


def plain_texts(prompts: list[str], max_tokens: int) -> list[str]:
    tok = Tokenizer.from_dir(DEMO_MODEL)
    opts = LocalOptions(model_dir=DEMO_MODEL, num_steps=3, max_seqs=len(prompts))
    engine = build_verifier(load_models(opts, speculative=False), opts, speculative=False)
    result = run_to_completion(engine, [tok.encode(p) for p in prompts],
                               SamplingParams(temperature=0.0),
                               StopConditions(max_tokens=max_tokens, ignore_eos=True))
    return [tok.decode(c.tokens) for c in result.completions]


def start_serve(state: str, args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CHAINSPEC_STATE_DIR": state, "RAY_AUTH_MODE": "disabled",
           "PYTHONUNBUFFERED": "1"}
    log = open(Path(state) / "serve.log", "w")  # noqa: SIM115 (lives as long as the stack)
    proc = subprocess.Popen([sys.executable, "-m", "chainspec.cli", "serve", "--port", str(port),
                             "--namespace", f"chainspec-soak-{os.getpid()}",
                             "--max-in-flight", str(4 * args.streams)],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = (Path(state) / "serve.log").read_text()
        if "Ctrl-C stops it." in text:
            print(f"stack up on port {port} (serve pid {proc.pid})", flush=True)
            return proc, f"http://127.0.0.1:{port}"
        if proc.poll() is not None:
            raise RuntimeError(f"chainspec serve exited {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    stop_serve(proc)
    raise RuntimeError("chainspec serve did not come up in 300 s")


def stop_serve(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


async def soak(url: str, serve_pid: int, prompts: list[str], expected: list[str], args
               ) -> dict:
    tally, samples = Tally(), []
    end = time.monotonic() + args.duration
    limits = httpx.Limits(max_connections=args.streams, max_keepalive_connections=args.streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        workers = [asyncio.create_task(worker(client, model, i, prompts, expected, end, tally,
                                              args.max_tokens)) for i in range(args.streams)]
        sampler = asyncio.create_task(sample_rss(serve_pid, end, args.sample_every, samples,
                                                 tally))
        await asyncio.gather(*workers)
        await sampler
        health = (await client.get("/health")).json()
    return {"tally": tally, "samples": samples, "health": health}


async def worker(client: httpx.AsyncClient, model: str, index: int, prompts: list[str],
                 expected: list[str], end: float, tally: Tally, max_tokens: int) -> None:
    n = index
    while time.monotonic() < end:
        i, stream = n % len(prompts), (n // len(prompts)) % 2 == 1
        n += 1
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        try:
            text = await (streamed(client, body) if stream else whole(client, body))
        except Exception as e:  # counted: the soak passes only with none
            tally.errors.append(f"{type(e).__name__}: {e}"[:300])
            await asyncio.sleep(0.5)
            continue
        tally.requests += 1
        tally.tokens += max_tokens
        if text != expected[i]:
            tally.mismatches.append(f"prompt {i}: {text[:60]!r} != {expected[i][:60]!r}")


async def whole(client: httpx.AsyncClient, body: dict) -> str:
    r = await client.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def streamed(client: httpx.AsyncClient, body: dict) -> str:
    parts = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)


async def sample_rss(serve_pid: int, end: float, every: float, samples: list[dict],
                     tally: Tally) -> None:
    t0 = time.monotonic()
    while True:
        samples.append({"t": round(time.monotonic() - t0, 1), "requests": tally.requests,
                        "rss": stack_rss(serve_pid)})
        if time.monotonic() >= end:
            return
        await asyncio.sleep(min(every, max(0.0, end - time.monotonic())))


def stack_rss(serve_pid: int) -> dict[str, int]:
    """RSS bytes of the serve process and everything it started, by a stable name."""
    out: dict[str, int] = {}
    try:
        root = psutil.Process(serve_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            name = p.name()
            if p.pid == serve_pid:
                name = "serve (gateway + driver)"
            elif name.startswith("ray::IDLE") or name in ("python", "python3"):
                continue  # idle pool workers come and go
            elif name.startswith("ray::"):
                name = name.split(".")[0]  # "ray::Controller.watch" while in a call
            rss = p.memory_info().rss
        except psutil.Error:
            continue
        out[name] = out.get(name, 0) + rss
    return out


def summarize(result: dict, args) -> dict:
    tally, samples = result["tally"], result["samples"]
    after = [s for s in samples if s["t"] >= args.warmup]
    names = sorted(set().union(*(s["rss"] for s in samples))) if samples else []
    processes = {}
    for name in names:
        series = [s["rss"][name] for s in after if name in s["rss"]]
        if len(series) < 6:
            continue
        base, last = sum(series[:3]) / 3, sum(series[-3:]) / 3
        processes[name] = {"rss_mb_after_warmup": round(base / 2 ** 20, 1),
                           "rss_mb_end": round(last / 2 ** 20, 1),
                           "growth": round(last / base - 1, 4)}
    worst = max((p["growth"] for p in processes.values()), default=None)
    passed = (not tally.errors and not tally.mismatches and worst is not None
              and worst < GROWTH_LIMIT)
    return {"duration_s": args.duration, "streams": args.streams, "max_tokens": args.max_tokens,
            "requests": tally.requests, "errors": len(tally.errors),
            "mismatches": len(tally.mismatches), "first_errors": tally.errors[:5],
            "first_mismatches": tally.mismatches[:5],
            "requests_per_s": round(tally.requests / args.duration, 2),
            "tokens_per_s": round(tally.tokens / args.duration, 1),
            "worst_rss_growth": worst, "growth_limit": GROWTH_LIMIT,
            "health_at_end": {k: result["health"].get(k) for k in
                              ("status", "verifiers", "drafters", "speculative")},
            "processes": processes, "passed": passed}


def write(report: dict, samples: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({**report, "samples": samples}, indent=1) + "\n")
    lines = [f"# Soak: {report['streams']} streams for {report['duration_s']:.0f} s",
             "", f"Command: `RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/soak.py "
             f"--duration {report['duration_s']:.0f} --streams {report['streams']}`", "",
             f"- requests: {report['requests']} ({report['requests_per_s']}/s, "
             f"{report['tokens_per_s']} tokens/s)",
             f"- errors: {report['errors']}; outputs different from plain: "
             f"{report['mismatches']}",
             f"- health at the end: {report['health_at_end']}",
             f"- worst RSS growth after warm-up: {report['worst_rss_growth']} "
             f"(limit {report['growth_limit']}); passed: {report['passed']}", "",
             "| process | RSS after warm-up (MB) | RSS at end (MB) | growth |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {p['rss_mb_after_warmup']} | {p['rss_mb_end']} | "
              f"{100 * p['growth']:+.2f} % |" for name, p in report["processes"].items()]
    lines += ["", "![RSS per process](soak_rss.png)", ""]
    (out / "soak.md").write_text("\n".join(lines))
    plot(samples, out / "soak_rss.png")


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(set().union(*(s["rss"] for s in samples))) if samples else []
    fig, ax = plt.subplots(figsize=(9, 5))
    for name in names:
        pts = [(s["t"], s["rss"][name] / 2 ** 20) for s in samples if name in s["rss"]]
        ax.plot([t for t, _ in pts], [m for _, m in pts], marker=".", label=name)
    ax.set_xlabel("seconds under load")
    ax.set_ylabel("RSS (MB)")
    ax.set_title("chainspec soak: resident memory per process")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

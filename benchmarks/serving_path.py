"""The serving path (issue 23, item 1): `chainspec serve` at concurrency 8 against the bare
engine at batch 8, plain and speculative, in one run, with CPU seconds per output token in
every process.

One run: start `chainspec serve` (the demo model, K=3, one verifier and one remote drafter
actor, on an embedded Ray with its own state dir and namespace), then --repeats times:
the bare engine at batch 8 (what `chainspec bench --batch-size 8` runs), then the served
points at concurrency 8: speculative, and plain (drafters scaled to 0 with `chainspec
scale`, then back). With --local-stack, the same again against `chainspec serve
--drafter-mode local` (speculative only: the MTP modules in the verifier process, as in
the bare engine, so the serving path is compared without the split's wire and hop). The
load generator is this process, pinned to the last core (`os.sched_setaffinity`); the
stack is left to the scheduler. Every request is a streamed `/v1/completions` of
--max-tokens tokens (greedy, ignore_eos) on the model's held-out prompts.

Every served point runs twice: at concurrency 8, and "full" at 8 + --queued (max_num_seqs
is 8, so a request always waits for a freed slot and 8 sequences run every step, as in the
bare engine's batches; at c=8 each request's turnaround costs its slot a few steps, and
equal-length requests finish in lockstep). Each point reports the verifier's mean batch
(sequences per step, from its /metrics) over the whole point and over its steady state
(until `concurrency` requests are left to send), and its figures over that steady state.

Per served point: output tokens/s, TPOT p50, and CPU seconds per output token of the
verifier actor, the drafter actor, the gateway (the `chainspec serve` process) and the load
generator, from /proc CPU-time deltas (psutil) over the point. The box is shared: CPU
seconds are the figure that other load does not move much; tokens/s is what the target
(>= 0.8x) reads, and the report gives beside it the CPU ratio: the bare engine's CPU per
token (its thread's CPU time) over the served critical path's (the verifier process plus
the drafter actor, which a round waits for in series). The bare engine runs in this
process (the functions `chainspec bench` runs: in-process drafter, batches of 8 run to
completion, speculative and plain interleaved, one torch thread).

With --profile SECONDS, one more speculative and one more plain pass run under `py-spy
record` (raw, --nonblocking, 200 Hz) of the verifier actor and the gateway, and the
report lists per thread the share of samples in each stage of the path (grouped by
file: engine step, stream messages, detokenizer, metrics, gRPC, gateway JSON/SSE, ...).
py-spy is not a dependency (`pip install py-spy`).

Usage: python benchmarks/serving_path.py [--repeats 2] [--requests 96] [--profile 8]
       [--queued 8] [--local-stack] [--label before] | --micro-only
Writes benchmarks/results/serving_path[_LABEL].{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import itertools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from chainspec.benchserve import stack
from chainspec.benchserve.client import send
from chainspec.benchserve.dataset import heldout
from chainspec.engine.local import DEMO_MODEL

RESULTS = Path(__file__).resolve().parent / "results"
NAMESPACE = "serving-path"
ROLES = {"ray::VerifierActor": "verifier", "ray::DrafterActor": "drafter"}
ORDER = ("verifier", "drafter", "gateway", "load generator")
TARGET = 0.8  # served / engine tokens/s at c=8 (issue 23)
ENGINE_PROMPTS = 32  # the bare engine's: 4 batches of 8
# py-spy frames -> a stage of the path (first match, innermost frame first)
STAGES = (("engine step", ("engine/verifier.py", "engine/scheduler", "models/", "torch/",
                           "engine/sampling", "engine/acceptance", "engine/kv", "kernels/",
                           "engine/draft", "engine/local", "engine/runner", "engine/block",
                           "engine/prefix", "engine/logits", "engine/adaptive",
                           "engine/request.py", "engine/batch", "engine/step")),
          ("drafter link", ("rpc/draft_pool", "rpc/drafter_link", "rpc/codec", "rpc/draft")),
          ("metrics", ("metrics/",)),
          ("detokenizer", ("engine/detokenizer", "tokenizers")),
          ("stream messages", ("rpc/verifier_service", "rpc/generate_codec",
                               "engine/async_engine", "google/protobuf")),
          ("gateway JSON/SSE", ("gateway/sse", "gateway/responses", "gateway/strict_json",
                                "json/", "gateway/fanout", "gateway/choices",
                                "gateway/logprobs")),
          ("gateway client/routing", ("gateway/client", "gateway/routing",
                                      "gateway/failover")),
          ("HTTP server", ("uvicorn", "starlette", "h11", "httptools", "anyio")),
          ("gRPC", ("grpc",)),
          ("asyncio", ("asyncio/",)),
          ("ray", ("ray/",)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_stack(port: int, env: dict, log: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "chainspec.cli", "serve", "--port", str(port),
           "--namespace", NAMESPACE, *extra]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(serve: subprocess.Popen) -> None:
    """SIGINT: serve stops the gateway, then the stack (and its embedded Ray)."""
    if serve.poll() is not None:
        return
    os.killpg(serve.pid, 2)
    try:
        serve.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, 9)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chainspec serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200 and \
                    httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("chainspec serve was not ready in time")


def stack_processes(serve: subprocess.Popen) -> dict[str, psutil.Process]:
    """The processes of the stack this script started: role -> process."""
    root = psutil.Process(serve.pid)
    procs = {"gateway": root, "load generator": psutil.Process()}
    for child in root.children(recursive=True):
        role = ROLES.get(child.name()) or ROLES.get(" ".join(child.cmdline()).strip())
        if role is not None:
            procs[role] = child
    return procs


def cpu_s(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for role, p in procs.items():
        try:
            t = p.cpu_times()
            out[role] = t.user + t.system
        except psutil.Error:
            out[role] = float("nan")
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name (py-spy dump); {} without py-spy."""
    try:
        out = subprocess.run(["py-spy", "dump", "--nonblocking", "--pid", str(pid)],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(m[1]): m[2] for m in re.finditer(r'^Thread (\d+) \(\w+\): "(.*)"', out,
                                                  re.M)}


def thread_cpu(proc: psutil.Process, names: dict[int, str]) -> collections.Counter:
    """CPU seconds by thread name (threads with no Python name: `native`)."""
    out: collections.Counter = collections.Counter()
    try:
        for t in proc.threads():
            out[names.get(t.id, "native")] += t.user_time + t.system_time
    except psutil.Error:
        pass
    return out


_ENGINES: dict = {}


def engine_bench(args) -> dict:
    """The bare engine at batch 8, as `chainspec bench --batch-size 8` runs it (the same
    functions: in-process drafter, every batch run to completion, speculative and plain
    interleaved), in this process on one thread: tokens/s, and CPU ms per token from
    the thread's CPU time, which other load on the box moves far less than wall time."""
    if not _ENGINES:
        import torch

        from chainspec.bench import load_prompts
        from chainspec.engine.local import LocalOptions, build_verifier, load_models
        from chainspec.models.tokenizer import Tokenizer
        torch.set_num_threads(args.threads)
        local = LocalOptions(model_dir=DEMO_MODEL)
        tok = Tokenizer.from_dir(DEMO_MODEL)
        models = load_models(local, speculative=True)
        _ENGINES.update({spec: build_verifier(models, local, spec, tok.eos_token_ids)
                         for spec in (True, False)})
        _ENGINES["prompts"] = [tok.encode(p) for p in load_prompts(DEMO_MODEL, ENGINE_PROMPTS)]
        for spec in (True, False):  # warm-up, as chainspec bench does
            _run_batches(_ENGINES[spec], _ENGINES["prompts"][:8], args.max_tokens)
    out = {}
    for spec in (True, False):
        engine = _ENGINES[spec]
        engine.observer = counter = _StepCounter()
        wall, cpu, tokens = _run_batches(engine, _ENGINES["prompts"], args.max_tokens)
        engine.observer = None
        mode = "spec" if spec else "plain"
        out[f"{mode}_tok_s"], out[f"{mode}_cpu_ms_per_token"] = tokens / wall, 1e3 * cpu / tokens
        out[f"{mode}_mean_batch"] = counter.items / max(counter.steps, 1)
    return out


class _StepCounter:
    """An engine observer: steps with work and the sequences they ran."""

    steps = items = 0

    def request_added(self, *_) -> None:
        pass

    def step_done(self, step) -> None:
        if step.work:
            self.steps += 1
            self.items += sum(w.num_rows > 0 for w in step.work)


def _run_batches(engine, prompts: list, max_tokens: int) -> tuple[float, float, int]:
    from chainspec.engine.request import StopConditions
    from chainspec.engine.runner import run_to_completion
    from chainspec.engine.sampling import SamplingParams
    greedy, stop = SamplingParams(temperature=0.0), StopConditions(max_tokens=max_tokens,
                                                                   ignore_eos=True)
    wall = cpu = 0.0
    tokens = 0
    for i in range(0, len(prompts), 8):
        t0, c0 = time.perf_counter(), time.thread_time()
        result = run_to_completion(engine, prompts[i:i + 8], greedy, stop)
        wall, cpu = wall + time.perf_counter() - t0, cpu + time.thread_time() - c0
        tokens += result.generated_tokens
    return wall, cpu, tokens


async def load(url: str, model: str, args, concurrency: int = 8,
               on_steady_end: Callable[[], None] | None = None) -> dict:
    """`args.requests` requests, `concurrency` at a time; tokens/s and TPOT p50.
    `on_steady_end()` runs when `concurrency` requests are left to send:
    up to the last send every finished request is replaced at once (the closed loop's
    steady state; after it the tail drains with fewer running), and the margin keeps
    its slow scrape inside it. `results`: the requests' timings."""
    data = heldout(DEMO_MODEL, args.max_tokens).requests
    queue = collections.deque(data[i % len(data)] for i in range(args.requests))
    results = []
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def worker() -> None:
            while queue:
                req = queue.popleft()
                if len(queue) == concurrency and on_steady_end is not None:
                    on_steady_end()  # NOTE: a few ms, on the loop: no GIL ping-pong
                results.append(await send(client, req, model))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[:3]}")
    tokens = sum(r.output_tokens for r in results)
    tpots = [r.tpot_s for r in results if r.tpot_s is not None]
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "t0": t0,
            "tpot_p50_ms": 1e3 * statistics.median(tpots), "results": results}


def verifier_metrics_urls(url: str) -> list[str]:
    """The verifiers' /metrics, found through the gateway's /v1/metrics/targets."""
    groups = httpx.get(f"{url}/v1/metrics/targets").raise_for_status().json()
    return [f"http://{t}{g['labels'].get('__metrics_path__', '/metrics')}"
            for g in groups if g["labels"].get("role") == "verifier" for t in g["targets"]]


STEP_COUNTERS = {"chainspec_verify_step_seconds_count": "steps",
                 "chainspec_verify_step_seconds_sum": "step_s",
                 "chainspec_draft_wait_seconds_sum": "step_s",
                 "chainspec_spec_decode_depth_total": "rounds",
                 "chainspec_generation_tokens_total": "tokens",
                 "chainspec_request_queue_time_seconds_count": "scheduled"}


def step_counters(urls: list[str]) -> dict[str, float]:
    """The verifiers' step counters: steps with work, their seconds (verify plus the draft
    wait), the sequences they ran (verify rounds of every depth, and requests scheduled:
    one final prefill item each, as the prompts fit one chunk), the tokens streamed.
    NOTE: only these samples are asked for (`name[]`) and read with a line scan: a full
    exposition parsed in Python took this process's GIL for seconds under load, which
    stalled the load generator's streams."""
    query = urllib.parse.urlencode([("name[]", n) for n in STEP_COUNTERS])
    out = dict.fromkeys(STEP_COUNTERS.values(), 0.0)
    for u in urls:
        with urllib.request.urlopen(f"{u}?{query}", timeout=30) as response:
            text = response.read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in STEP_COUNTERS:
                out[STEP_COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


def snapshot(urls: list[str], procs: dict) -> dict:
    """CPU times now, then the verifiers' counters (a scrape that the verifier renders
    between its own steps: 0.1-0.9 s under load here, so its counters serve as ratios)."""
    t, cpu = time.perf_counter(), cpu_s(procs)
    steps = step_counters(urls)
    return {"t": t, "cpu": cpu, "steps": steps, "scrape_s": time.perf_counter() - t}


def tokens_by(results: list, t: float) -> float:
    """Output tokens the client had received by `t` (each request's tokens spread over
    its text chunks: a chunk carries one token plain, a round's speculative)."""
    total = 0.0
    for r in results:
        if r.ttft_s is None:
            continue
        times = list(itertools.accumulate([r.start_s + r.ttft_s, *r.itl_s]))
        total += r.output_tokens * bisect.bisect_right(times, t) / len(times)
    return total


def occupancy(before: dict, after: dict) -> dict:
    """Mean sequences per verifier step between two snapshots (verify rounds of every
    depth plus requests scheduled, one final prefill item each: the prompts fit one
    chunk), and the steps' seconds (verify plus the draft wait)."""
    d = {k: after["steps"][k] - before["steps"][k] for k in before["steps"]}
    return {"verifier_steps": int(d["steps"]), "step_s": d["step_s"],
            "mean_batch": (d["rounds"] + d["scheduled"]) / max(d["steps"], 1)}


def served_point(url: str, model: str, args, procs, concurrency: int = 8) -> dict:
    """One load point; CPU ms per output token by process, and by thread in the verifier
    and the gateway (where the GIL is shared); the verifier's occupancy, over the whole
    point and over its steady state (`steady`: up to `concurrency` requests before the
    last send: tokens the client had by then, CPU by then, the mean batch by then)."""
    names = {role: thread_names(procs[role].pid) for role in ("verifier", "gateway")}
    threads = {role: thread_cpu(procs[role], names[role]) for role in names}
    urls = verifier_metrics_urls(url)
    start, mark = snapshot(urls, procs), {}
    r = asyncio.run(load(url, model, args, concurrency,
                         on_steady_end=lambda: mark.update(snapshot(urls, procs))))
    end, results = snapshot(urls, procs), r.pop("results")
    r.update(occupancy(start, end))
    r["busy_share"] = r.pop("step_s") / r["wall_s"]
    tokens = tokens_by(results, mark["t"])
    wall = mark["t"] - r["t0"]
    r["steady"] = {"tokens": round(tokens), "wall_s": wall, "tok_s": tokens / wall,
                   "mean_batch": occupancy(start, mark)["mean_batch"],
                   "scrape_s": mark["scrape_s"],
                   "cpu_ms_per_token": {role: 1e3 * (mark["cpu"][role] - start["cpu"][role])
                                        / tokens if role in procs else 0.0
                                        for role in ORDER}}
    r["cpu_ms_per_token"] = {role: 1e3 * (end["cpu"][role] - start["cpu"][role]) /
                             r["tokens"] if role in procs else 0.0
                             for role in ORDER}  # 0: none runs
    r["thread_cpu_ms_per_token"] = {}
    for role, begin in threads.items():
        delta = thread_cpu(procs[role], names[role])
        delta.subtract(begin)
        r["thread_cpu_ms_per_token"][role] = {
            name: round(1e3 * v / r["tokens"], 4) for name, v in delta.most_common() if v > 0}
    return r


def scale(url: str, n: int) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            await stack.scale_drafters(client, n, ["--namespace", NAMESPACE])
    asyncio.run(go())


def profile(url: str, model: str, args, procs, out_dir: Path, mode: str) -> dict:
    """A pass under py-spy (verifier, gateway): thread -> stage -> share of samples.
    NOTE: the load outlasts the recording (about 20 requests a second at most here)."""
    spies = {}
    for role in ("verifier", "gateway"):
        path = out_dir / f"{role}_{mode}.txt"
        spies[role] = (path, subprocess.Popen(
            ["py-spy", "record", "--pid", str(procs[role].pid), "--rate", "200",
             "--format", "raw", "--nonblocking", "--threads", "-d", str(args.profile),
             "-o", str(path)], stdout=subprocess.DEVNULL,
            stderr=(out_dir / f"{role}_{mode}.log").open("w")))
    asyncio.run(load(url, model, argparse.Namespace(**{**vars(args),
                                                       "requests": 24 * args.profile})))
    shares = {}
    for role, (path, spy) in spies.items():
        spy.wait(timeout=args.profile + 30)
        shares[role] = stage_shares(path) if path.exists() else {}
    return shares


def stage_shares(path: Path) -> dict:
    """Collapsed stacks -> {thread: {stage: share of that process's busy samples}}."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack_text, _, n = line.rpartition(" ")
        frames = stack_text.split(";")
        thread = frames[0].split(" ")[-1].strip('"()') if frames else "?"
        if frames and "(idle)" in frames[0]:
            continue
        counts["all"][stage_of(frames)] += int(n)
        counts[thread][stage_of(frames)] += int(n)
    return {t: {s: round(v / sum(c.values()), 3) for s, v in c.most_common()}
            | {"samples": sum(c.values())} for t, c in counts.items()}


def stage_of(frames: list[str]) -> str:
    for frame in reversed(frames[1:]):
        for stage, keys in STAGES:
            if any(k in frame for k in keys):
                return stage
    return "other"


def micro(n: int = 2000) -> dict:
    """CPU microseconds per message of each stage after the engine's commit, in this
    process (no stack, so other load moves it little): one request's outputs of one token
    (plain) and of three (a speculative round), the demo tokenizer, no logprobs."""
    from chainspec.engine.request import FinishReason, RequestOutput, RequestStats
    from chainspec.gateway.choices import Shape
    from chainspec.gateway.responses import CompletionFormat, Envelope
    from chainspec.gateway.sse import stream_events
    from chainspec.models.tokenizer import Tokenizer
    from chainspec.rpc.generated.v1 import verifier_pb2 as pb
    from chainspec.rpc.verifier_service import _ResponseWriter

    tok = Tokenizer.from_dir(DEMO_MODEL)
    ids = tok.encode(" ".join(json.loads((DEMO_MODEL / "heldout_prompts.json").read_text())))
    out: dict = {}
    for per in (1, 3):
        steps = [tuple(ids[i:i + per]) for i in range(0, per * n, per)]
        outs = [RequestOutput("r", t) for t in steps]
        outs[-1] = RequestOutput("r", steps[-1], FinishReason.LENGTH,
                                 stats=RequestStats(3))
        for stops in ((), ("\n\n", "###")):
            writer = _ResponseWriter("r", ids[:16], tok, stops)
            t0 = time.thread_time()
            msgs = [m for o in outs for m in writer.messages(o)]
            out[f"writer {per} tok, {len(stops)} stops"] = (time.thread_time() - t0) / n
        t0 = time.thread_time()
        wire = [m.SerializeToString() for m in msgs]
        out[f"serialize {per} tok"] = (time.thread_time() - t0) / n
        t0 = time.thread_time()
        parsed = [pb.GenerateResponse.FromString(b) for b in wire]
        out[f"parse {per} tok"] = (time.thread_time() - t0) / n

        class Stream:
            def __init__(self, msgs) -> None:
                self.msgs = msgs

            async def messages(self):
                for m in self.msgs:
                    yield m

            def close(self):
                pass

        async def sse(parsed=parsed) -> int:
            events = stream_events([Stream(parsed)], CompletionFormat,
                                   Envelope("cmpl-1", 1, "demo"), True, Shape())
            return sum([len(e) async for e in events])
        t0 = time.thread_time()
        asyncio.run(sse())
        out[f"gateway SSE {per} tok"] = (time.thread_time() - t0) / n
    return {k: round(v * 1e6, 2) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=96, help="requests per point")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine bench")
    p.add_argument("--queued", type=int, default=8, help="the full points' requests "
                   "beyond the 8 running (concurrency 8 + this)")
    p.add_argument("--profile", type=int, default=0, help="py-spy seconds (0: off)")
    p.add_argument("--local-stack", action="store_true",
                   help="also serve with --drafter-mode local (speculative points)")
    p.add_argument("--label", default="", help="results file suffix (before, after)")
    p.add_argument("--micro-only", action="store_true", help="print the stage microbenchmark")
    args = p.parse_args(argv)
    if args.micro_only:
        print(json.dumps(micro(), indent=1))
        return 0
    state = Path(tempfile.mkdtemp(prefix="serving-path-"))
    env = {**os.environ, "CHAINSPEC_STATE_DIR": str(state), "RAY_AUTH_MODE": "disabled",
           "OMP_NUM_THREADS": str(args.threads)}
    os.environ.update(env)  # `chainspec scale` (a child) finds the stack in `state`
    cores = sorted(os.sched_getaffinity(0))
    runs, shares = run_stack(args, env, state, cores, [])
    local = run_stack(args, env, state, cores, ["--drafter-mode", "local"])[0] \
        if args.local_stack else []
    report = summarize(args, argv, runs, shares, cores, local)
    stem = "serving_path" + (f"_{args.label}" if args.label else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def run_stack(args, env: dict, state: Path, cores: list[int], extra: list[str]
              ) -> tuple[list[dict], dict]:
    """`args.repeats` runs against one stack (`extra`: its flags); a remote-drafter
    stack also serves plain (drafters scaled to 0) and is profiled."""
    remote = not extra
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    os.sched_setaffinity(0, cores)  # NOTE: the stack's processes inherit it
    serve = start_stack(port, env, state / f"serve{'-'.join(extra)}.log", extra)
    runs, shares = [], {}
    try:
        wait_ready(url, serve)
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[-1]})  # the load generator's own core
        procs = stack_processes(serve)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(load(url, model, argparse.Namespace(**{**vars(args), "requests": 8})))
        full = 8 + args.queued  # NOTE: max_num_seqs is 8: `queued` wait, 8 run every step
        for _ in range(args.repeats):
            run = {"load_avg_1m": os.getloadavg()[0], "engine": engine_bench(args),
                   "serve_spec": served_point(url, model, args, procs),
                   "serve_spec_full": served_point(url, model, args, procs, full)}
            if remote:
                scale(url, 0)
                plain = stack_processes(serve)
                run["serve_plain"] = served_point(url, model, args, plain)
                run["serve_plain_full"] = served_point(url, model, args, plain, full)
                scale(url, 1)
                procs = stack_processes(serve)  # NOTE: a new drafter actor, a new process
            runs.append(run)
            print(json.dumps(run), flush=True)
        if remote and args.profile:
            shares["spec"] = profile(url, model, args, procs, state, "spec")
            scale(url, 0)
            shares["plain"] = profile(url, model, args, stack_processes(serve), state, "plain")
    finally:
        stop(serve)
        os.sched_setaffinity(0, cores)
    return runs, shares


def summarize(args, argv, runs, shares, cores, local: list[dict]) -> dict:
    def med(path: tuple[str, ...]) -> float:
        vals = []
        for r in runs:
            v = r
            for k in path:
                v = v[k]
            vals.append(v)
        return statistics.median(vals)
    roles = list(runs[0]["serve_spec"]["cpu_ms_per_token"])
    out = {"argv": argv if argv is not None else sys.argv[1:], "cores": len(cores),
           "load_generator_core": cores[-1] if len(cores) > 1 else None,
           "requests": args.requests, "max_tokens": args.max_tokens, "runs": runs,
           "local_runs": local,
           "profile": shares}
    out["micro_us_per_message"] = micro()
    for mode, engine_mode, point, rs in (("plain", "plain", "serve_plain", runs),
                                         ("spec", "spec", "serve_spec", runs),
                                         ("spec_local", "spec", "serve_spec", local)):
        if rs:
            out[mode] = mode_summary(rs, engine_mode, point, roles)
            out[f"{mode}_full"] = mode_summary(rs, engine_mode, f"{point}_full", roles)
    return out


def mode_summary(runs: list[dict], engine_mode: str, point: str, roles: list[str]) -> dict:
    """Medians over runs, and ratios per run: tokens/s served over the engine's, over the
    whole point and over its steady state (what the target reads; other load on the box
    moves both), and CPU: the engine's CPU ms per token over the served critical path's
    in the steady state (the verifier process, plus the drafter actor, which a g1 round
    waits for in series); that is the tokens/s ratio a box with a core for each process
    would give."""
    def med(f) -> float:
        return statistics.median(f(r) for r in runs)
    engine = lambda r, k: r["engine"][f"{engine_mode}_{k}"]  # noqa: E731
    steady = lambda r: r[point]["steady"]  # noqa: E731
    ratios = [r[point]["tok_s"] / engine(r, "tok_s") for r in runs]
    steady_ratios = [steady(r)["tok_s"] / engine(r, "tok_s") for r in runs]
    cpu_ratios = [engine(r, "cpu_ms_per_token") /
                  (steady(r)["cpu_ms_per_token"]["verifier"] +
                   steady(r)["cpu_ms_per_token"]["drafter"]) for r in runs]
    return {"engine_tok_s": med(lambda r: engine(r, "tok_s")),
            "engine_cpu_ms_per_token": med(lambda r: engine(r, "cpu_ms_per_token")),
            "engine_mean_batch": med(lambda r: engine(r, "mean_batch")),
            "serve_tok_s": med(lambda r: r[point]["tok_s"]),
            "steady_tok_s": med(lambda r: steady(r)["tok_s"]),
            "mean_batch": med(lambda r: r[point]["mean_batch"]),
            "steady_mean_batch": med(lambda r: steady(r)["mean_batch"]),
            "busy_share": med(lambda r: r[point]["busy_share"]),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "steady_ratio": statistics.median(steady_ratios), "steady_ratios": steady_ratios,
            "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios,
            "serve_tpot_p50_ms": med(lambda r: r[point]["tpot_p50_ms"]),
            "serve_cpu_ms_per_token": {
                role: statistics.median(steady(r)["cpu_ms_per_token"][role] for r in runs)
                for role in roles}}


def markdown(r: dict) -> str:
    roles = list(r["spec"]["serve_cpu_ms_per_token"])
    lines = ["# Serving path: `chainspec serve` at c=8 vs the bare engine at batch 8",
             "", f"`python benchmarks/serving_path.py {' '.join(r['argv'])}`", "",
             f"Demo model, K=3, CPU ({r['cores']} cores, shared with other work; load "
             f"generator pinned to core {r['load_generator_core']}); {r['requests']} requests "
             f"of {r['max_tokens']} tokens per point, medians of {len(r['runs'])} runs. "
             "plain and spec: `chainspec serve` as it starts (a remote drafter actor; plain: "
             "drafters scaled to 0); spec_local: `chainspec serve --drafter-mode local` (the "
             "MTP modules in the verifier, as in the bare engine).", "",
             "Load average (1 min) at each run's start: " +
             ", ".join(f"{x['load_avg_1m']:.1f}" for x in r["runs"]) + ".", "",
             "The steady state is the closed loop until `concurrency` requests are left "
             "to send (every finished request replaced at once; after the last send the "
             "tail drains with fewer running). Mean batch: sequences per verifier step "
             "(the bare engine's: per step of its batches of 8). CPU figures are the "
             "steady state's. `_full` points: concurrency 8 + --queued with max_num_seqs "
             "8, so a request always waits for a freed slot and 8 run every step, as in "
             "the engine's batches (the c=8 points lose occupancy to each request's "
             "turnaround: finish, client, gateway, admission, prefill).", "",
             "| mode | engine tok/s (b=8) | engine mean batch | serve tok/s (c=8, whole) | "
             "serve mean batch (whole, steady) | verifier busy (whole) | "
             "serve/engine, whole (per run) | steady (per run) | target | "
             "CPU ratio (per run) | serve TPOT p50 (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    modes = [m for base in ("plain", "spec", "spec_local") for m in (base, f"{base}_full")
             if m in r]
    for mode in modes:
        m = r[mode]
        per = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        lines.append(f"| {mode} | {m['engine_tok_s']:.0f} | {m['engine_mean_batch']:.2f} | "
                     f"{m['serve_tok_s']:.0f} | {m['mean_batch']:.2f}, "
                     f"{m['steady_mean_batch']:.2f} | {m['busy_share']:.0%} | "
                     f"{m['ratio']:.2f}x ({per(m['ratios'])}) | "
                     f"{m['steady_ratio']:.2f}x ({per(m['steady_ratios'])}) | >= {TARGET} "
                     f"({'met' if m['steady_ratio'] >= TARGET else 'not met'}) | "
                     f"{m['cpu_ratio']:.2f}x ({per(m['cpu_ratios'])}) | "
                     f"{m['serve_tpot_p50_ms']:.1f} |")
    engine = ", ".join(f"{m} {r[m]['engine_cpu_ms_per_token']:.3f}" for m in modes)
    lines += ["", "CPU ms per output token, each process over the point (the bare engine, "
              f"its thread's CPU time: {engine}):", "",
              "| mode | " + " | ".join(roles) + " | stack total |",
              "|---|" + "---|" * (len(roles) + 1)]
    for mode in modes:
        c = r[mode]["serve_cpu_ms_per_token"]
        total = sum(v for k, v in c.items() if k != "load generator")
        lines.append(f"| {mode} | " + " | ".join(f"{c[k]:.3f}" for k in roles) +
                     f" | {total:.3f} |")
    lines += ["", "Per message after the engine's commit, in one process (µs of CPU; "
              "`--micro-only`): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                            r["micro_us_per_message"].items()) + "."]
    for mode in ("plain", "spec"):
        for role, threads in r["runs"][-1][f"serve_{mode}"]["thread_cpu_ms_per_token"].items():
            text = ", ".join(f"{name} {v:.3f}" for name, v in threads.items())
            lines += ["", f"{mode}, {role} threads (CPU ms per token, last run): {text}"]
    for mode, role, threads in [(m, role, t) for m, by_role in r["profile"].items()
                                for role, t in by_role.items()]:
        lines += ["", f"py-spy, {role}, {mode} (busy samples by stage):", "",
                  "| thread | samples | stages |", "|---|---|---|"]
        for thread, stages in threads.items():
            n = stages.get("samples", 0)
            text = ", ".join(f"{s} {v:.0%}" for s, v in stages.items() if s != "samples")
            lines.append(f"| {thread} | {n} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

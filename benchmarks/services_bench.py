"""Services benchmark: plain vs speculative in one process vs speculative over gRPC with
the verifier and the drafter in separate Ray actors (DESIGN 4.4), greedy, batch 1 and 8.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/services_bench.py \
        [--model DIR] [--batch 1 8] [--max-tokens 128] [--out benchmarks/results/services]

Figures per batch size:
- tokens/s of each mode (generated tokens / wall time; gRPC: measured at the client);
- round_ms: engine step time (one verify round) -- in process from the engine loop, over
  gRPC from the verifier actor's own counters;
- draft_wait_ms: how long a gRPC round waited for drafts (collect start .. drafts in hand);
- drafter_ms: the drafter's compute per round, in process and inside the drafter actor;
- wire_ms = draft_wait - drafter compute (actor) + the verifier's request encode: what
  the wire (serialization both ways, transfer, thread hops) costs a round; wire_share =
  wire_ms / gRPC round_ms; extra_round_ms = round_ms(gRPC) - round_ms(in process), which
  also holds process effects (GIL, scheduling) and machine noise;
- codec_ms: serialization alone (encode + decode of the round's request and response),
  replayed offline on updates captured from the in-process run;
- bytes_per_round: protobuf payload bytes sent + received by the verifier's draft pool.
Outputs of every mode are compared with plain decoding (lossless: true/false).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import ray
import torch

from chainspec.cluster import stack
from chainspec.cluster.config import StackConfig
from chainspec.engine.draft_types import DraftBatch, DraftReply
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.draft_codec import (
    DraftLimits,
    decode_draft_request,
    decode_draft_response,
    encode_draft_request,
    encode_draft_response,
)
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.generated.v1 import verifier_pb2_grpc as pb_grpc

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def ",
           "for i in range(10):\n", "def main():\n    parser = ", "# Read a file\nwith open(",
           "if __name__ == \"__main__\":\n", "def quicksort(items):\n"]
NS = "chainspec-bench"
GREEDY = SamplingParams(temperature=0.0)


# ------------------------------------------------------------------------ in process


class TimedClient:
    """An in-process draft client (as LocalDraftClient) that times the drafter's compute
    and keeps a few rounds of updates and outcomes for the offline codec measurement."""

    def __init__(self, engine, keep: int = 64) -> None:
        self.engine, self.keep = engine, keep
        self.calls, self.seconds = 0, 0.0
        self.rounds: list[tuple[list, list]] = []
        self._ready: dict = {}

    def submit(self, updates) -> None:
        t0 = time.perf_counter()
        outcomes = self.engine.update(updates)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        for upd, out in zip(updates, outcomes, strict=True):
            self._ready[upd.seq_id] = out
        if len(self.rounds) < self.keep and self.calls > 2:
            self.rounds.append((list(updates), list(outcomes)))

    def collect(self):
        ready, self._ready = self._ready, {}
        return ready

    def release(self, seq_ids) -> None:
        self.engine.release(seq_ids)


def run_local(models, opts: LocalOptions, prompts, max_tokens: int, speculative: bool) -> dict:
    engine = build_verifier(models, opts, speculative)
    if speculative:
        engine.drafter = TimedClient(engine.drafter.engine)
    stop = StopConditions(max_tokens=max_tokens, ignore_eos=True)
    run_to_completion(engine, prompts[:1], GREEDY, StopConditions(max_tokens=8, ignore_eos=True))
    if speculative:
        engine.drafter.calls, engine.drafter.seconds, engine.drafter.rounds = 0, 0.0, []
    result = run_to_completion(engine, prompts, GREEDY, stop)
    out = {"tokens_per_s": result.generated_tokens / result.seconds,
           "seconds": result.seconds, "steps": result.steps,
           "round_ms": 1e3 * result.seconds / result.steps,
           "outputs": [c.tokens for c in result.completions]}
    if speculative:
        client = engine.drafter
        out["drafter_ms"] = 1e3 * client.seconds / max(client.calls, 1)
        out["acceptance_length"] = merged_stats(result.completions,
                                                opts.num_steps).acceptance_length
        out["encode_ms"], out["codec_ms"] = codec_ms(client.rounds, models.target.config,
                                                     opts.num_steps)
    return out


def codec_ms(rounds, cfg, k: int) -> tuple[float, float]:
    """Mean (verifier-side request encode, all four encodes/decodes) of one round, ms."""
    if not rounds:
        return float("nan"), float("nan")
    limits = DraftLimits(cfg.hidden_size, cfg.vocab_size, k)
    encode = total = 0.0
    for i, (updates, outcomes) in enumerate(rounds):
        t0 = time.perf_counter()
        req = encode_draft_request(DraftBatch(i, tuple(updates)))
        t1 = time.perf_counter()
        decode_draft_request(pb_parse(req), limits)
        resp = encode_draft_response(DraftReply(i, tuple(outcomes)))
        decode_draft_response(pb_parse(resp), limits)
        encode, total = encode + t1 - t0, total + time.perf_counter() - t0
    return 1e3 * encode / len(rounds), 1e3 * total / len(rounds)


def pb_parse(msg):
    """Through bytes, as on the wire."""
    return type(msg).FromString(msg.SerializeToString())


# ------------------------------------------------------------------------- over gRPC


def run_grpc(endpoint: str, actors, prompts, max_tokens: int) -> dict:
    channel = grpc.insecure_channel(endpoint)
    stub = pb_grpc.VerifierStub(channel)
    results: list = [None] * len(prompts)

    def call(i: int) -> None:
        req = pb.GenerateRequest(tokens=pb.PromptTokens(ids=prompts[i]),
                                 stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=True))
        tokens, stats = [], None
        for msg in stub.Generate(req, timeout=600):
            if msg.HasField("chunk"):
                tokens.extend(msg.chunk.token_ids)
            else:
                stats = msg.finished.stats
        results[i] = (tokens, stats)
    call(0)  # warm-up: channel, drafter stream
    before = ray.get([a.stats.remote() for a in actors])
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = ray.get([a.stats.remote() for a in actors])
    channel.close()
    d = {key: a[key] - b[key] for a, b in zip(after, before, strict=True) for key in a}
    steps = max(d["steps"], 1)
    stats = [s for _, s in results]
    rounds = sum(s.rounds - s.fallback_rounds for s in stats)
    return {"tokens_per_s": sum(len(t) for t, _ in results) / wall, "seconds": wall,
            "steps": d["steps"], "round_ms": 1e3 * d["step_s_total"] / steps,
            "draft_wait_ms": 1e3 * d["wait_s_total"] / max(d["rounds"], 1),
            "drafter_remote_ms": 1e3 * d["update_s_total"] / max(d["updates"], 1),
            "bytes_per_round": (d["bytes_sent"] + d["bytes_received"]) / steps,
            "late_batches": d["late_batches"],
            "fallback_rounds": sum(s.fallback_rounds for s in stats),
            "acceptance_length": 1 + sum(s.accepted_tokens for s in stats) / max(rounds, 1),
            "outputs": [t for t, _ in results]}


def start_stack(model: Path, k: int, max_seqs: int, max_len: int):
    """A stack of one verifier and one drafter actor; returns (endpoint, [actors])."""
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    stack.up(StackConfig(model_dir=str(model), num_steps=k, max_seqs=max_seqs,
                         max_len=max_len, namespace=NS, health_interval_s=2.0))
    actors = [ray.get_actor(f"chainspec-{m}-0", namespace=NS) for m in ("verifier", "drafter")]
    endpoint = [m for m in stack.status(namespace=NS) if m["role"] == "verifier"][0]["endpoint"]
    deadline = time.monotonic() + 60
    channel = grpc.insecure_channel(endpoint)
    while pb_grpc.VerifierStub(channel).Info(pb.VerifierInfoRequest()).drafters < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the verifier never connected to the drafter")
        time.sleep(0.2)
    channel.close()
    return endpoint, actors


# ---------------------------------------------------------------------------- report


def median_run(runs: list[dict]) -> dict:
    """Per-metric median over repeated runs (outputs from the first)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def summarize(batch: int, plain: dict, local: dict, remote: dict) -> dict:
    # NOTE: the draft wait holds transfer, both sides' codec but the verifier's encode,
    # and the drafter's compute (measured in the drafter actor); the wire is the rest.
    wire = remote["draft_wait_ms"] - remote["drafter_remote_ms"] + local["encode_ms"]
    return {
        "batch": batch,
        "plain_tok_s": plain["tokens_per_s"],
        "spec_local_tok_s": local["tokens_per_s"],
        "spec_grpc_tok_s": remote["tokens_per_s"],
        "speedup_local": local["tokens_per_s"] / plain["tokens_per_s"],
        "speedup_grpc": remote["tokens_per_s"] / plain["tokens_per_s"],
        "acceptance_length_local": local["acceptance_length"],
        "acceptance_length_grpc": remote["acceptance_length"],
        "plain_round_ms": plain["round_ms"],
        "local_round_ms": local["round_ms"],
        "grpc_round_ms": remote["round_ms"],
        "drafter_ms": local["drafter_ms"],
        "drafter_remote_ms": remote["drafter_remote_ms"],
        "draft_wait_ms": remote["draft_wait_ms"],
        "wire_ms": wire,
        "wire_share": wire / remote["round_ms"],
        "extra_round_ms": remote["round_ms"] - local["round_ms"],
        "codec_ms": local["codec_ms"],
        "bytes_per_round": remote["bytes_per_round"],
        "late_batches": remote["late_batches"],
        "fallback_rounds": remote["fallback_rounds"],
        "lossless_local": local["outputs"] == plain["outputs"],
        "lossless_grpc": remote["outputs"] == plain["outputs"],
    }


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# services_bench ({meta['model']})", "",
             f"{meta['host']}; torch threads {meta['threads']}; K={meta['k']}; "
             f"{meta['max_tokens']} tokens per request; greedy; median of {meta['repeats']} "
             f"interleaved runs; load average at the end "
             f"{', '.join(f'{x:.1f}' for x in meta['load_average'])}.", "",
             "| batch | plain tok/s | spec in-process tok/s | spec gRPC tok/s | gRPC speedup "
             "| acc. len | round ms (plain / local / gRPC) | drafter ms (local / actor) "
             "| draft wait ms | wire ms (share) | codec ms | bytes/round | lossless |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['plain_tok_s']:.1f} | {r['spec_local_tok_s']:.1f} "
            f"({r['speedup_local']:.2f}x) | {r['spec_grpc_tok_s']:.1f} "
            f"| {r['speedup_grpc']:.2f}x | {r['acceptance_length_grpc']:.2f} "
            f"| {r['plain_round_ms']:.2f} / {r['local_round_ms']:.2f} / {r['grpc_round_ms']:.2f} "
            f"| {r['drafter_ms']:.2f} / {r['drafter_remote_ms']:.2f} | {r['draft_wait_ms']:.2f} "
            f"| {r['wire_ms']:.2f} ({100 * r['wire_share']:.0f}%) | {r['codec_ms']:.2f} "
            f"| {r['bytes_per_round']:.0f} | {r['lossless_local'] and r['lossless_grpc']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEMO_MODEL)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; medians reported")
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_dir(args.model)
    prompts = [tok.encode(t) for t in PROMPTS]
    opts = LocalOptions(model_dir=args.model, num_steps=args.k, max_seqs=max(args.batch),
                        max_len=args.max_len)
    models = load_models(opts)
    endpoint, actors = start_stack(args.model, args.k, max(args.batch), args.max_len)
    rows = []
    try:
        for batch in args.batch:
            batch_prompts = (prompts * batch)[:batch]
            runs: dict[str, list[dict]] = {"plain": [], "local": [], "grpc": []}
            for _ in range(args.repeats):  # interleaved, so load changes hit every mode
                runs["plain"].append(run_local(models, opts, batch_prompts, args.max_tokens,
                                               False))
                runs["local"].append(run_local(models, opts, batch_prompts, args.max_tokens,
                                               True))
                runs["grpc"].append(run_grpc(endpoint, actors, batch_prompts,
                                             args.max_tokens))
            rows.append(summarize(batch, *(median_run(runs[m]) for m in runs)))
            print(json.dumps(rows[-1], indent=1), flush=True)
    finally:
        stack.down(namespace=NS)
        ray.shutdown()
    meta = {"model": str(args.model), "k": args.k, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "load_average": os.getloadavg(),
            "threads": args.threads, "host": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}, torch {torch.__version__}"}
    report = markdown(rows, meta)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                            indent=1))
        args.out.with_suffix(".md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())

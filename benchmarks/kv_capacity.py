"""Concurrency at a fixed KV budget: fixed slots vs the paged KV cache, in the same bytes.

Fixed slots reserve a whole slot per sequence whatever its real length, so a budget of B
bytes admits B / slot_bytes sequences. A server sizes its slots by the context it offers
(today's default: the model's; here a model with 4096 positions), because it cannot know
how long a request will grow; `--slot-len fit` is the most favourable case for slots, the
shortest slot that holds this workload's longest request (prompt + 2048 generated + K + 1).
For each slot length the paged engine gets the same bytes as blocks and runs a queue of
requests with the demo's held-out prompts and generation lengths drawn log-uniform in
64..2048 (fixed seed): we count running sequences at every step while the queue is
non-empty (the pool is the only limit; max_seqs is set out of the way), and the
preemptions it needed. Plain decoding of a random-weight model shaped like the demo
target (2 layers, positions up to 4096): capacity depends on lengths, not weights.

Bound for `fit`: a running sequence's mean current length, weighted by how long it runs,
is prompt + E[G^2] / (2 E[G]) (~560 positions here), so no paged scheme without swapping
runs more than ~3.8x the `fit` slots on this length mix.

Usage: python benchmarks/kv_capacity.py [--requests 96] [--slots 8] [--slot-len fit,4096]
Writes benchmarks/results/kv_capacity.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from chainspec.bench import load_prompts
from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.local import DEMO_MODEL
from chainspec.engine.request import StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.verifier import VerifierConfig, VerifierEngine
from chainspec.models.config import ModelConfig
from chainspec.models.kv_cache import block_bytes
from chainspec.models.target import TargetModel
from chainspec.models.tokenizer import Tokenizer

K, BLOCK, MIN_GEN, MAX_GEN = 3, 16, 64, 2048
RESULTS = Path(__file__).resolve().parent / "results"


def workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    tok = Tokenizer.from_dir(DEMO_MODEL)
    prompts = [tok.encode(t) for t in load_prompts(DEMO_MODEL, n)]
    rng = random.Random(seed)
    gens = [round(math.exp(rng.uniform(math.log(MIN_GEN), math.log(MAX_GEN))))
            for _ in range(n)]
    return prompts, gens


def model() -> TargetModel:
    cfg = dataclasses.replace(ModelConfig.from_dir(DEMO_MODEL), num_layers=2, max_position=4096)
    torch.manual_seed(0)
    return TargetModel(cfg).eval()


def run_paged(target: TargetModel, prompts, gens, budget_bytes: int, max_len: int) -> dict:
    cfg = VerifierConfig(num_steps=K, max_seqs=256, max_len=max_len, max_batch_tokens=2048,
                         kv=KVBudget(memory_bytes=budget_bytes, block_size=BLOCK))
    eng = VerifierEngine(target, cfg)
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        eng.add_request(str(i), p, SamplingParams(temperature=0.0),
                        StopConditions(max_tokens=g, ignore_eos=True))
    running, usage, generated, t0 = [], [], 0, time.perf_counter()
    while eng.has_work:
        saturated = bool(eng.waiting)  # requests still queued: the pool is the limit
        for out in eng.step():
            generated += len(out.new_tokens)
        if saturated:
            running.append(eng.num_running)
            usage.append(eng.allocator.usage)
    assert generated == sum(gens), "every request ran to its length"
    return {"blocks": eng.allocator.num_blocks, "steps": eng.steps,
            "saturated_steps": len(running), "mean_running": statistics.mean(running),
            "median_running": statistics.median(running), "max_running": max(running),
            "mean_block_usage": statistics.mean(usage), "preemptions": eng.preemptions,
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--slots", type=int, default=8, help="fixed slots the budget holds")
    p.add_argument("--slot-len", default="fit",
                   help="comma-separated fixed slot lengths (positions); 'fit' is the "
                        "shortest that holds this workload's longest request")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    prompts, gens = workload(args.requests, args.seed)
    target = model()
    fit = BLOCK * math.ceil((max(map(len, prompts)) + MAX_GEN + K + 1) / BLOCK)
    lens = [fit if x.strip() == "fit" else int(x) for x in args.slot_len.split(",")]
    if min(lens) < fit:
        raise SystemExit(f"a slot must hold the longest request: >= {fit} positions")
    report = {
        "command": "python benchmarks/" + Path(__file__).name + " " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "requests": args.requests, "seed": args.seed, "k": K, "block_size": BLOCK,
        "prompt_tokens_mean": statistics.mean(map(len, prompts)),
        "gen_tokens_mean": statistics.mean(gens), "gen_tokens_min": min(gens),
        "gen_tokens_max": max(gens), "slots_admitted": args.slots, "fit_len": fit,
        "runs": [one_budget(target, prompts, gens, args.slots, n) for n in lens],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_capacity.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "kv_capacity.md").write_text(markdown(report))
    print(json.dumps(report, indent=2))
    return 0


def one_budget(target: TargetModel, prompts, gens, slots: int, slot_len: int) -> dict:
    """Paged in the bytes of `slots` fixed slots of `slot_len` positions."""
    c = target.config
    per_token = block_bytes(c.num_layers, 1, c.num_kv_heads, c.head_dim, torch.float32)
    budget = slots * slot_len * per_token
    paged = run_paged(target, prompts, gens, budget, slot_len)
    # sequences that fit at once if each held its whole final length from the start
    totals = [math.ceil((len(p) + g + K + 1) / BLOCK) for p, g in zip(prompts, gens,
                                                                       strict=True)]
    whole = paged["blocks"] / statistics.mean(totals)
    return {"slot_len": slot_len, "budget_bytes": budget, "paged": paged,
            "ratio_mean_running": round(paged["mean_running"] / slots, 2),
            "ratio_median_running": round(paged["median_running"] / slots, 2),
            "fit_whole_lengths": round(whole, 1),
            "ratio_fit_whole_lengths": round(whole / slots, 2)}


def markdown(r: dict) -> str:
    head = (f"# KV capacity at a fixed budget\n\n`{r['command'].strip()}`\n\n"
            f"{r['requests']} requests: held-out prompts (mean {r['prompt_tokens_mean']:.0f}"
            f" tokens), generation lengths log-uniform {MIN_GEN}..{MAX_GEN} (seed "
            f"{r['seed']}, mean {r['gen_tokens_mean']:.0f}). Each budget is the bytes of "
            f"{r['slots_admitted']} fixed slots of the given length; the shortest slot "
            f"that holds this workload's longest request is {r['fit_len']} positions.\n\n"
            "| fixed slot length | budget (blocks of 16) | fixed slots | paged: sequences "
            "running while the queue is non-empty (mean / median / max) | ratio (mean) | "
            "preemptions | paged, whole final lengths reserved |\n"
            "|---|---|---|---|---|---|---|\n")
    rows = []
    for run in r["runs"]:
        p = run["paged"]
        rows.append(f"| {run['slot_len']} | {p['blocks']} | {r['slots_admitted']} | "
                    f"{p['mean_running']:.1f} / {p['median_running']} / {p['max_running']} | "
                    f"**{run['ratio_mean_running']}x** | {p['preemptions']} | "
                    f"{run['fit_whole_lengths']} ({run['ratio_fit_whole_lengths']}x) |")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())

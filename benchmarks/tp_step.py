"""Tensor-parallel step time: TP=2 vs TP=1 on CPU, and where a TP=2 step's time goes.

Two shapes (`--shape`): `llama8b`, random weights, 2 layers (`--layers`) of hidden 4096,
32 heads over 8 KV heads, head dim 128, MLP 14336, vocab cut to 32000 (as in
`mixed_lengths.py --shape llama8b`); and `demo`, the shipped demo model (14 layers of
hidden 128: per-step overhead dominates). One verify step: `--seqs` sequences of K+1 = 4
rows each at position `--context`, through the engine's paged path, then the LM head
over every row. TP=2 runs the real group: rank 0's `TPLeader` (which sends each step's
inputs to the other ranks) and a spawned follower, one thread per rank, gloo. Reported:
median step time; per step on rank 0, the all-reduces and gathers and their time
(which includes waiting for the slower rank), the step-input messages and their time
(packing + broadcast), and the rest (compute); each rank's parameter bytes.
Usage: python benchmarks/tp_step.py [--shape llama8b|demo|both] [--layers 2]
       [--repeats N] [--seqs 4] [--baseline results/tp_step_baseline.json]
Writes benchmarks/results/tp_step.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from chainspec.engine.local import DEMO_MODEL
from chainspec.engine.tp_group import GroupAddress, TPLeader, follow, join, leave, one_thread
from chainspec.models.attention import AttnBatch, PagedAttention, SeqRows
from chainspec.models.config import ModelConfig, read_hf_config
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.loader import load_target
from chainspec.models.target import TargetModel
from chainspec.models.tensor_parallel import CollectiveStats, TPGroup, empty_weights, shard_target
from chainspec.models.tp_loader import load_target_shard

RESULTS = Path(__file__).parent / "results"
BLOCK = 16
ROWS_PER_SEQ = 4  # K + 1 at K = 3
SHAPES = ("llama8b", "demo")


def llama8b(layers: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_layers=layers, num_heads=32,
                       num_kv_heads=8, head_dim=128, max_position=8192)


def random_model(cfg: ModelConfig, tp: TPGroup | None) -> TargetModel:
    """Random weights of rank tp's shard (None: the whole model), never a full copy."""
    with empty_weights():
        model = TargetModel(cfg)
    if tp is not None:
        shard_target(model, tp)
    gen = torch.Generator().manual_seed(0 if tp is None else tp.rank)
    state = {k: torch.randn(v.shape, generator=gen) * 0.02
             for k, v in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def build(shape: str, layers: int, tp: TPGroup | None) -> TargetModel:
    """Rank tp's shard (None: TP=1) of the benchmark's model."""
    if shape == "llama8b":
        return random_model(llama8b(layers), tp)
    if tp is None:
        return load_target(DEMO_MODEL).eval()
    return load_target_shard(DEMO_MODEL, tp).eval()


def step_inputs(seqs: int, context: int, device: str | torch.device = "cpu",
                vocab: int = 32000) -> tuple[torch.Tensor, AttnBatch, int]:
    blocks_per_seq = -(-(context + ROWS_PER_SEQ) // BLOCK)
    rows = [SeqRows(list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), context,
                    ROWS_PER_SEQ) for i in range(seqs)]
    batch = AttnBatch.build(rows, BLOCK, device=device)
    ids = torch.randint(0, vocab, (seqs * ROWS_PER_SEQ,), device=device)
    return ids, batch, seqs * blocks_per_seq


def timed_steps(model, cache: ModelKVCache, ids, batch, repeats: int,
                stats: CollectiveStats | None = None) -> dict:
    times, per_step = [], []
    with torch.inference_mode():
        for i in range(repeats + 1):  # the first is a warm-up
            if stats is not None:
                stats.reset()
            t0 = time.perf_counter()
            hidden = model(ids, batch.positions, PagedAttention(cache, batch,
                                                                model.attention_scale))
            model.logits(hidden)
            if i:
                times.append(time.perf_counter() - t0)
                if stats is not None:
                    per_step.append(dataclasses.replace(stats))
    out = {"step_ms": _ms(statistics.median(times))}
    if stats is not None:
        first = per_step[0]
        collective = statistics.median(s.seconds for s in per_step)
        messages = statistics.median(s.broadcast_seconds for s in per_step)
        out.update(all_reduces_per_step=first.all_reduces,
                   gathers_per_step=first.gathers,
                   collective_ms=_ms(collective), messages_per_step=first.broadcasts,
                   message_ms=_ms(messages),
                   compute_ms=_ms(statistics.median(times) - collective - messages))
    return out


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 2)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def all_reduce_floor(tp: TPGroup, rows: int, hidden: int, repeats: int = 200) -> float:
    """Seconds of one all-reduce of [rows, hidden] fp32 with nothing else running (both
    ranks call it back to back): the transport's latency on this machine."""
    x = torch.zeros(rows, hidden)
    for _ in range(20):
        tp.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(repeats):
        tp.all_reduce(x)
    return (time.perf_counter() - t0) / repeats


def _follower(address: GroupAddress, shape: str, layers: int, rows: int, hidden: int
              ) -> None:
    one_thread()
    tp, channel = join(address, 1)
    all_reduce_floor(tp, rows, hidden)
    try:
        follow(build(shape, layers, tp), channel)
    finally:
        leave()


def run_tp(shape: str, layers: int, seqs: int, context: int, repeats: int) -> dict:
    address = GroupAddress.local(2)
    hidden = llama8b(layers).hidden_size if shape == "llama8b" else \
        read_hf_config(DEMO_MODEL)["hidden_size"]
    rows = seqs * ROWS_PER_SEQ
    proc = mp.get_context("spawn").Process(target=_follower,
                                           args=(address, shape, layers, rows, hidden))
    proc.start()
    tp, channel = join(address, 0)
    floor = all_reduce_floor(tp, rows, hidden)
    try:
        leader = TPLeader(build(shape, layers, tp), channel)
        ids, batch, blocks = step_inputs(seqs, context, vocab=leader.config.vocab_size)
        cache = ModelKVCache(leader.cache_specs(), {None: blocks}, BLOCK)
        out = timed_steps(leader, cache, ids, batch, repeats, tp.stats)
        out["param_bytes_per_rank"] = param_bytes(leader.shard)
        out["all_reduce_alone_ms"] = _ms(floor)
        leader.close()
    finally:
        proc.join(60)
        leave()
    return out


def run_tp1(shape: str, layers: int, seqs: int, context: int, repeats: int) -> dict:
    model = build(shape, layers, None)
    ids, batch, blocks = step_inputs(seqs, context, vocab=model.config.vocab_size)
    cache = ModelKVCache(model.cache_specs(), {None: blocks}, BLOCK)
    out = timed_steps(model, cache, ids, batch, repeats)
    out["param_bytes_per_rank"] = param_bytes(model)
    return out


def measure(shape: str, args: argparse.Namespace) -> dict:
    layers = args.layers if shape == "llama8b" else build(shape, 0, None).config.num_layers
    repeats = args.repeats or (10 if shape == "llama8b" else 60)
    tp1 = run_tp1(shape, args.layers, args.seqs, args.context, repeats)
    tp2 = run_tp(shape, args.layers, args.seqs, args.context, repeats)
    return {"shape": shape, "layers": layers, "rows": args.seqs * ROWS_PER_SEQ,
            "context": args.context, "repeats": repeats, "tp1": tp1, "tp2": tp2,
            "speedup": round(tp1["step_ms"] / tp2["step_ms"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", choices=(*SHAPES, "both"), default="both")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=0, help="0: 10 (llama8b), 60 (demo)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="an earlier tp_step.json, shown beside (before/after)")
    ap.add_argument("--out", type=Path, default=RESULTS / "tp_step.json")
    args = ap.parse_args()
    one_thread()
    shapes = SHAPES if args.shape == "both" else (args.shape,)
    report = {"threads_per_rank": 1, "backend": "gloo",
              "runs": [measure(shape, args) for shape in shapes]}
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report, baseline))
    print(json.dumps(report, indent=1))


def markdown(report: dict, baseline: dict | None = None) -> str:
    before = {r["shape"]: r for r in (baseline or {}).get("runs", [])}
    lines = ["# Tensor-parallel step time (CPU, gloo)\n",
             "`python benchmarks/tp_step.py`: one verify step of `rows` rows at position "
             "`context` plus the LM head, one thread per rank, median of the repeats. "
             "Per TP=2 step on rank 0: collectives (all-reduces, gathers; their time "
             "includes waiting for the other rank), step-input messages (packing and "
             "broadcast), and the rest (compute).\n"]
    for r in report["runs"]:
        t1, t2 = r["tp1"], r["tp2"]
        lines += [f"## {r['shape']}: {r['layers']} layers, {r['rows']} rows at position "
                  f"{r['context']}\n",
                  "| | step ms | all-reduces | gathers | collective ms | messages | "
                  "message ms | compute ms | parameter MB per rank |",
                  "|---|---|---|---|---|---|---|---|---|"]
        old = before.get(r["shape"])
        if old is not None:
            lines += [_row("TP=1 before", old["tp1"]), _row("TP=2 before", old["tp2"])]
        lines += [_row("TP=1", t1), _row("TP=2", t2), "",
                  f"TP=2 over TP=1: {r['speedup']}x"
                  + (f" (before: {old['speedup']}x)" if old else "")
                  + f"; one all-reduce of [{r['rows']}, hidden] alone: "
                  f"{t2['all_reduce_alone_ms']} ms.\n"]
    lines.append("All-reduces: one per block (attention, MLP) per layer plus one for the "
                 "vocab-parallel embedding; the gather (to rank 0) is the LM head's. The machine's "
                 "two cores are shared with other work, so the absolute times are noisy.\n")
    return "\n".join(lines)


def _row(name: str, r: dict) -> str:
    def get(key):
        return r.get(key, 0)
    return (f"| {name} | {r['step_ms']} | {get('all_reduces_per_step')} | "
            f"{get('gathers_per_step') or get('all_gathers_per_step')} | {get('collective_ms')} | "
            f"{get('messages_per_step')} | {get('message_ms')} | "
            f"{r.get('compute_ms', r['step_ms'])} | {r['param_bytes_per_rank'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()

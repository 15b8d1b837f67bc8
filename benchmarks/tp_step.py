"""Tensor-parallel step time: TP=2 vs TP=1 on layers shaped like an 8B Llama, on CPU.

Random weights, 2 layers (`--layers`) of hidden 4096, 32 heads over 8 KV heads, head dim
128, MLP 14336; vocab cut to 32000 (as in `mixed_lengths.py --shape llama8b`). One verify
step: `--seqs` sequences of K+1 = 4 rows each at position `--context`, through the
engine's paged path, then the LM head over every row. TP=2 runs the real group: rank 0's
`TPLeader` (which broadcasts each step's ids and AttnBatch) and a spawned follower, one
thread per rank, gloo. Reported: median step time, all-reduces and all-gathers per step
and their time on rank 0 (which includes waiting for the slower rank), and each rank's
parameter bytes.
Usage: python benchmarks/tp_step.py [--layers 2] [--repeats 10] [--seqs 4]
Writes benchmarks/results/tp_step.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from chainspec.engine.tp_group import GroupAddress, TPLeader, follow, join, leave, one_thread
from chainspec.models.attention import AttnBatch, PagedAttention, SeqRows
from chainspec.models.config import ModelConfig
from chainspec.models.kv_cache import ModelKVCache
from chainspec.models.target import TargetModel
from chainspec.models.tensor_parallel import TPGroup, empty_weights, shard_target

RESULTS = Path(__file__).parent / "results"
BLOCK = 16
ROWS_PER_SEQ = 4  # K + 1 at K = 3


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


def step_inputs(seqs: int, context: int, device: str | torch.device = "cpu",
                vocab: int = 32000) -> tuple[torch.Tensor, AttnBatch, int]:
    blocks_per_seq = -(-(context + ROWS_PER_SEQ) // BLOCK)
    rows = [SeqRows(list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), context,
                    ROWS_PER_SEQ) for i in range(seqs)]
    batch = AttnBatch.build(rows, BLOCK, device=device)
    ids = torch.randint(0, vocab, (seqs * ROWS_PER_SEQ,), device=device)
    return ids, batch, seqs * blocks_per_seq


def timed_steps(model, cache: ModelKVCache, ids, batch, repeats: int, stats=None) -> dict:
    times, reduces, gathers, comm = [], [], [], []
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
                    reduces.append(stats.all_reduces)
                    gathers.append(stats.all_gathers)
                    comm.append(stats.seconds)
    out = {"step_ms": round(1e3 * statistics.median(times), 1)}
    if stats is not None:
        out.update(all_reduces_per_step=reduces[0], all_gathers_per_step=gathers[0],
                   collective_ms=round(1e3 * statistics.median(comm), 1))
    return out


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _follower(address: GroupAddress, layers: int) -> None:
    one_thread()
    tp, channel = join(address, 1)
    try:
        follow(random_model(llama8b(layers), tp), channel)
    finally:
        leave()


def run_tp(layers: int, seqs: int, context: int, repeats: int) -> dict:
    address = GroupAddress.local(2)
    proc = mp.get_context("spawn").Process(target=_follower, args=(address, layers))
    proc.start()
    tp, channel = join(address, 0)
    try:
        leader = TPLeader(random_model(llama8b(layers), tp), channel)
        ids, batch, blocks = step_inputs(seqs, context)
        cache = ModelKVCache(leader.cache_specs(), {None: blocks}, BLOCK)
        out = timed_steps(leader, cache, ids, batch, repeats, tp.stats)
        out["param_bytes_per_rank"] = param_bytes(leader.shard)
        leader.close()
    finally:
        proc.join(60)
        leave()
    return out


def run_tp1(layers: int, seqs: int, context: int, repeats: int) -> dict:
    model = random_model(llama8b(layers), None)
    ids, batch, blocks = step_inputs(seqs, context)
    cache = ModelKVCache(model.cache_specs(), {None: blocks}, BLOCK)
    out = timed_steps(model, cache, ids, batch, repeats)
    out["param_bytes_per_rank"] = param_bytes(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    one_thread()
    tp1 = run_tp1(args.layers, args.seqs, args.context, args.repeats)
    tp2 = run_tp(args.layers, args.seqs, args.context, args.repeats)
    report = {"shape": "llama8b layers, vocab 32000", "layers": args.layers,
              "rows": args.seqs * ROWS_PER_SEQ, "context": args.context,
              "threads_per_rank": 1, "backend": "gloo", "tp1": tp1, "tp2": tp2,
              "speedup": round(tp1["step_ms"] / tp2["step_ms"], 3)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tp_step.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "tp_step.md").write_text(markdown(report))
    print(json.dumps(report, indent=1))


def markdown(r: dict) -> str:
    t1, t2 = r["tp1"], r["tp2"]
    return (
        "# Tensor-parallel step time (CPU, gloo)\n\n"
        f"`python benchmarks/tp_step.py --layers {r['layers']}`: {r['layers']} layers shaped "
        f"like an 8B Llama ({r['shape']}), one verify step of {r['rows']} rows at position "
        f"{r['context']} plus the LM head, one thread per rank, median of the repeats.\n\n"
        "| | step ms | all-reduces / step | all-gathers / step | collective ms / step "
        "(rank 0) | parameter MB per rank |\n|---|---|---|---|---|---|\n"
        f"| TP=1 | {t1['step_ms']} | 0 | 0 | 0 | {t1['param_bytes_per_rank'] / 2**20:.0f} |\n"
        f"| TP=2 | {t2['step_ms']} | {t2['all_reduces_per_step']} | "
        f"{t2['all_gathers_per_step']} | {t2['collective_ms']} | "
        f"{t2['param_bytes_per_rank'] / 2**20:.0f} |\n\n"
        f"Speedup TP=2 over TP=1: {r['speedup']}x. All-reduces: one per block (attention, "
        "MLP) per layer plus one for the vocab-parallel embedding; the all-gather is the "
        "LM head's. Collective time on rank 0 includes waiting for the other rank. The "
        "machine's two cores are shared with other work, so the absolute times are noisy.\n")


if __name__ == "__main__":
    main()

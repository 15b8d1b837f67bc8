"""Services benchmark, every mode side by side in one run on one machine, greedy:

- plain: the verifier engine alone, in this process;
- in-process: speculative, the drafter engine called directly (`chainspec generate`'s path);
- stack local: a Ray stack with `drafter.mode: local` -- the verifier actor runs its MTP
  modules in its own process (the co-located baseline the split must beat);
- gRPC g1 / g2: a Ray stack whose verifier actor reaches a drafter actor over gRPC, with
  1 pipelined group (no overlap) and with 2 (DESIGN 4.8).

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/services_bench.py \
        [--model DIR] [--batch 1 4 8 16] [--max-tokens 128] [--repeats 3] \
        [--pin] [--out benchmarks/results/services_bench]

The stack modes are measured at a gRPC client of the verifier (Generate), so stack local
vs gRPC is like for like; in-process and plain carry no Generate overhead. Repeats run the
modes in ABBA order (forward, then reversed) so load drifts hit every mode alike; medians.

Figures per batch size and mode: tokens/s; round_ms (verifier step time); draft_wait_ms
(how long a step waited for drafts); drafter_ms (the drafter's compute per draft batch,
in the drafter actor or in the verifier process); acceptance length. For gRPC g1:
wire_ms = draft_wait - drafter compute + the verifier's request encode (serialization both
ways, transfer, thread hops) and wire_share = wire_ms / round_ms; for every remote mode
wait_share = draft_wait / round_ms (what the drafter and the wire cost a step, after any
overlap). codec_ms: encode + decode of a round's request and response, replayed offline
on updates captured in process. Outputs of every mode are compared with plain (lossless).

`--pin` gives each role cores of its own (`os.sched_setaffinity` on every thread of each
process, from inside each actor; the placement read back is in the results): this
process (plain, in-process, and the gRPC client) and every verifier actor on core 0,
every drafter actor on core 1. So the co-located modes run on one core and the split on
two, the placement a split deployment has on devices of its own. It also raises every
pinned thread's priority (`--pin-nice`, default -10, the same for every role): on a box
shared with other sessions, their processes otherwise time-slice a role's core, which a
device of its own never does (measured: a drafter round on a shared core 1 took 3-4.4 ms
idle between rounds, 1.8 ms at nice -10, 1.5 ms busy in process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import ray
import torch

from chainspec.cluster import stack
from chainspec.cluster.config import DrafterRoleConfig, StackConfig
from chainspec.engine.draft_types import DraftReply, UpdateBatch
from chainspec.engine.local import (
    DEMO_MODEL,
    DrafterMode,
    LocalDrafts,
    LocalOptions,
    build_verifier,
    load_models,
)
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
# stack mode -> (drafter mode, pipeline groups, draft-ahead)
STACKS = {"stack_local": (DrafterMode.LOCAL, 1, False), "grpc_g1": (DrafterMode.REMOTE, 1, False),
          "grpc_g2": (DrafterMode.REMOTE, 2, False),
          "grpc_ahead": (DrafterMode.REMOTE, 1, True)}
REMOTE = ("grpc_g1", "grpc_g2", "grpc_ahead")
MODES = ("plain", "inproc", *STACKS)


# ------------------------------------------------------------------------ placement

VERIFIER_CORES, DRAFTER_CORES = {0}, {1}


def pin_process(cores: set[int], nice: int = 0) -> dict:
    """Pin every thread of this process to `cores` at priority `nice` (new threads
    inherit both); returns the affinity and the main thread's priority read back."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            if nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:  # NOTE: a thread that ended meanwhile
            pass
    return {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
            "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def pin_actor(actor, cores: set[int], nice: int = 0) -> dict:
    """Run `pin_process` inside `actor`'s process; its pid and placement."""
    def pin(_self, cores, nice):
        return pin_process(cores, nice)
    return ray.get(actor.__ray_call__.remote(pin, cores, nice))


# ------------------------------------------------------------------------ in process


class TimedClient(LocalDrafts):
    """The in-process drafter (it times its own compute) keeping a few rounds of updates
    and outcomes for the offline codec measurement."""

    def __init__(self, engine, keep: int = 64) -> None:
        super().__init__(engine)
        self.keep = keep
        self.rounds: list[tuple[list, list]] = []

    def submit(self, updates) -> None:
        super().submit(updates)
        if len(self.rounds) < self.keep and self.stats.rounds > 2:
            self.rounds.append((list(updates), [self._ready[u.seq_id] for u in updates]))


def run_local(models, opts: LocalOptions, prompts, max_tokens: int, speculative: bool) -> dict:
    engine = build_verifier(models, opts, speculative)
    if speculative:
        engine.drafter = TimedClient(engine.drafter.engine)
    stop = StopConditions(max_tokens=max_tokens, ignore_eos=True)
    run_to_completion(engine, prompts[:1], GREEDY, StopConditions(max_tokens=8, ignore_eos=True))
    if speculative:
        engine.drafter.stats.rounds, engine.drafter.stats.draft_s_total = 0, 0.0
        engine.drafter.rounds = []
    result = run_to_completion(engine, prompts, GREEDY, stop)
    out = {"tokens_per_s": result.generated_tokens / result.seconds,
           "seconds": result.seconds, "steps": result.steps,
           "round_ms": 1e3 * result.seconds / result.steps,
           "outputs": [c.tokens for c in result.completions]}
    if speculative:
        st = engine.drafter.stats
        out["drafter_ms"] = 1e3 * st.draft_s_total / max(st.rounds, 1)
        out["acceptance_length"] = merged_stats(result.completions,
                                                opts.num_steps).acceptance_length
        out["encode_ms"], out["codec_ms"] = codec_ms(engine.drafter.rounds,
                                                     models.target.config, opts.num_steps)
    return out


def codec_ms(rounds, cfg, k: int) -> tuple[float, float]:
    """Mean (verifier-side request encode, all four encodes/decodes) of one round, ms."""
    if not rounds:
        return float("nan"), float("nan")
    limits = DraftLimits(cfg.hidden_size, cfg.vocab_size, k)
    encode = total = 0.0
    for i, (updates, outcomes) in enumerate(rounds):
        t0 = time.perf_counter()
        req = encode_draft_request(UpdateBatch(i, tuple(updates)))
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
    """Every prompt at once through the verifier's Generate; counters from the actors."""
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
    ranks_before = rank_hits(actors[0])
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = ray.get([a.stats.remote() for a in actors])
    channel.close()
    d: dict[str, float] = {}
    for a, b in zip(after, before, strict=True):
        for key in a:
            d[key] = d.get(key, 0) + a[key] - b[key]
    steps = max(d["steps"], 1)
    # drafter compute: the drafter actor's (remote) or the verifier's in-process drafter's
    draft_s = d.get("update_s_total", d.get("draft_s_total", 0.0))
    draft_batches = max(d.get("updates", d.get("rounds", 0)), 1)
    stats = [s for _, s in results]
    rounds = sum(s.rounds - s.fallback_rounds for s in stats)
    return {"tokens_per_s": sum(len(t) for t, _ in results) / wall, "seconds": wall,
            "steps": d["steps"], "round_ms": 1e3 * d["step_s_total"] / steps,
            "step_s_total": d["step_s_total"], "wait_s_total": d.get("wait_s_total", 0.0),
            "draft_s_total": draft_s, "draft_batches": draft_batches,
            "draft_wait_ms": 1e3 * d.get("wait_s_total", 0.0) / steps,
            "drafter_ms": 1e3 * draft_s / draft_batches,
            "bytes_per_round": (d.get("bytes_sent", 0) + d.get("bytes_received", 0)) / steps,
            "late_batches": d.get("late_batches", 0),
            "ahead_hits": d.get("ahead_hits", 0), "ahead_misses": d.get("ahead_misses", 0),
            "ahead_rank_hits": {**{r: n - ranks_before.get(r, 0)
                                   for r, n in rank_hits(actors[0]).items()},
                                "rounds": rounds,
                                "all_accepted": sum(s.accepted_tokens for s in stats)},
            "fallback_rounds": sum(s.fallback_rounds for s in stats),
            "acceptance_length": 1 + sum(s.accepted_tokens for s in stats) / max(rounds, 1),
            "outputs": [t for t, _ in results]}


def rank_hits(verifier) -> dict[str, int]:
    """Look-ahead hits so far by the rank of the entry that matched (0: the likeliest),
    and (keys "drafts", "accepted") the draft tokens of rounds that verified a hit's
    drafts and how many of them were accepted."""
    def read(self):
        out = {str(r): n for r, n in self.server.engine.engine.ahead_rank_hits.items()}
        m = self.server.metrics
        if m is not None:
            with m.recorder.lock:
                out["drafts"] = int(m.ahead_draft_tokens.value)
                out["accepted"] = int(sum(c.value for c in m.ahead_per_pos))
        return out
    return ray.get(verifier.__ray_call__.remote(read))


def start_stack(name: str, model: Path, k: int, max_seqs: int, max_len: int):
    """Stack `name` of STACKS (one verifier actor, and one drafter actor unless local);
    returns (endpoint, [actors])."""
    mode, groups, ahead = STACKS[name]
    ns = f"{NS}-{name.replace('_', '-')}"
    stack.up(StackConfig(model_dir=str(model), num_steps=k, max_seqs=max_seqs,
                         max_len=max_len, namespace=ns, health_interval_s=2.0,
                         drafter=DrafterRoleConfig(mode=mode), pipeline_groups=groups,
                         draft_ahead=ahead))
    roles = ("verifier",) if mode is DrafterMode.LOCAL else ("verifier", "drafter")
    actors = [ray.get_actor(f"chainspec-{m}-0", namespace=ns) for m in roles]
    endpoint = [m for m in stack.status(namespace=ns) if m["role"] == "verifier"][0]["endpoint"]
    deadline = time.monotonic() + 60
    channel = grpc.insecure_channel(endpoint)
    while pb_grpc.VerifierStub(channel).Info(pb.VerifierInfoRequest()).drafters < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the verifier never connected to a drafter")
        time.sleep(0.2)
    channel.close()
    return endpoint, actors


# ---------------------------------------------------------------------------- report


def median_run(runs: list[dict]) -> dict:
    """Per-metric median over repeated runs (outputs from the first)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, dict):  # counts: summed over the runs
            out[key] = {k: sum(r[key].get(k, 0) for r in runs)
                        for k in set().union(*(r[key] for r in runs))}
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def ahead_acceptance(run: dict, k: int) -> dict:
    """Acceptance length of the draft-ahead mode's rounds that verified a hit's drafts
    and of the others (exact drafts). NOTE: a hit's next round verifies its entry (K
    drafts, or K-1 from a bonus pass alone), unless the hit ended its request: hit rounds
    are counted as hits, a slight overcount."""
    counts = run["ahead_rank_hits"]  # NOTE: summed over the runs
    hit_rounds = sum(n for r, n in counts.items() if r.isdigit())
    rounds, accepted = counts["rounds"], counts["all_accepted"]
    hit_acc = counts.get("accepted", 0)
    return {"grpc_ahead_hit_drafts": counts.get("drafts", 0) / hit_rounds
            if hit_rounds else None,
            "grpc_ahead_al_hit": 1 + hit_acc / hit_rounds if hit_rounds else None,
            "grpc_ahead_al_exact": 1 + (accepted - hit_acc) / (rounds - hit_rounds)
            if rounds > hit_rounds else None}


def summarize(batch: int, runs: dict[str, dict], k: int) -> dict:
    plain, inproc = runs["plain"], runs["inproc"]
    row = {"batch": batch, "acceptance_length": inproc["acceptance_length"],
           "codec_ms": inproc["codec_ms"], "drafter_inproc_ms": inproc["drafter_ms"],
           "plain_round_ms": plain["round_ms"], "inproc_round_ms": inproc["round_ms"]}
    for mode in MODES:
        row[f"{mode}_tok_s"] = runs[mode]["tokens_per_s"]
        row[f"lossless_{mode}"] = runs[mode]["outputs"] == plain["outputs"]
    ahead = runs["grpc_ahead"]
    row["grpc_ahead_rank_hits"] = {r: n for r, n in ahead["ahead_rank_hits"].items()
                                   if r.isdigit()}
    row.update(ahead_acceptance(ahead, k))
    for mode in STACKS:
        r = runs[mode]
        row[f"{mode}_round_ms"] = r["round_ms"]
        row[f"{mode}_draft_wait_ms"] = r["draft_wait_ms"]
        row[f"{mode}_drafter_ms"] = r["drafter_ms"]
        row[f"{mode}_acceptance_length"] = r["acceptance_length"]
        row[f"{mode}_fallback_rounds"] = r["fallback_rounds"]
        if mode != "stack_local":
            row[f"{mode}_wait_share"] = r["wait_s_total"] / r["step_s_total"]
            row[f"{mode}_bytes_per_round"] = r["bytes_per_round"]
            row[f"{mode}_late_batches"] = r["late_batches"]
            looked = r["ahead_hits"] + r["ahead_misses"]
            row[f"{mode}_ahead_hit_rate"] = r["ahead_hits"] / looked if looked else None
    g1 = runs["grpc_g1"]
    # NOTE: the draft wait holds transfer, both sides' codec but the verifier's encode,
    # and the drafter's compute (measured in the drafter actor); the wire is the rest.
    wire_s = g1["wait_s_total"] - g1["draft_s_total"] + \
        1e-3 * inproc["encode_ms"] * g1["draft_batches"]
    row["wire_ms"] = 1e3 * wire_s / max(g1["steps"], 1)
    row["wire_share"] = wire_s / g1["step_s_total"]
    best = max(REMOTE, key=lambda m: row[f"{m}_tok_s"])
    row["best_remote"] = best
    for base in ("inproc", "stack_local", "plain"):
        for mode in REMOTE:
            row[f"{mode}_vs_{base}"] = row[f"{mode}_tok_s"] / row[f"{base}_tok_s"]
    row["inproc_vs_plain"] = row["inproc_tok_s"] / row["plain_tok_s"]
    row["stack_local_vs_plain"] = row["stack_local_tok_s"] / row["plain_tok_s"]
    row["lossless"] = all(row[f"lossless_{m}"] for m in MODES)
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# services_bench ({meta['model']})", "",
             f"{meta['host']}; torch threads {meta['threads']}; K={meta['k']}; "
             f"{meta['max_tokens']} tokens per request; greedy; median of {meta['repeats']} "
             f"ABBA-interleaved runs; load average at the start "
             f"{', '.join(f'{x:.1f}' for x in meta['load_average_start'])}, at the end "
             f"{', '.join(f'{x:.1f}' for x in meta['load_average'])}.", "",
             placement_line(meta), "",
             "Tokens/s (x plain):", "",
             "| batch | plain | spec in-process | stack local | gRPC g1 | gRPC g2 "
             "| gRPC draft-ahead | acc. len | lossless (all 6) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['plain_tok_s']:.1f}"] + [
            f"{r[f'{m}_tok_s']:.1f} ({r[f'{m}_tok_s'] / r['plain_tok_s']:.2f}x)"
            for m in MODES[1:]]
        lines.append(f"| {r['batch']} | {' | '.join(cells)} | {r['acceptance_length']:.2f} "
                     f"| {r['lossless']} |")
    lines += ["", "Ratios of the remote (gRPC) modes (g1, g2, draft-ahead):", "",
              "| batch | / in-process | / stack local | / plain | ahead hit rate "
              "| ahead draft wait ms | ahead acc. len |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratios = [" / ".join(f"{r[f'{m}_vs_{b}']:.2f}" for m in REMOTE)
                  for b in ("inproc", "stack_local", "plain")]
        hit = r["grpc_ahead_ahead_hit_rate"]
        lines.append(f"| {r['batch']} | " + " | ".join(ratios) +
                     f" | {'-' if hit is None else f'{100 * hit:.0f}%'} "
                     f"| {r['grpc_ahead_draft_wait_ms']:.2f} "
                     f"| {r['grpc_ahead_acceptance_length']:.2f} |")
    lines += ["", "Draft-ahead hits by rank of the matching hypothesis (0: the likeliest; "
              "all runs), and acceptance length of rounds verifying a hit's drafts vs "
              "exact drafts, and drafts per hit round (K, or K-1 from a bonus pass "
              "alone):", "", "| batch | hits by rank | acc. len hit / exact | drafts per "
              "hit round |", "|---|---|---|---|"]
    for r in rows:
        ranks = r["grpc_ahead_rank_hits"]
        cells = ", ".join(f"{k}: {ranks[k]}" for k in sorted(ranks, key=int)) or "-"
        al = " / ".join("-" if r[f"grpc_ahead_al_{w}"] is None
                        else f"{r[f'grpc_ahead_al_{w}']:.2f}" for w in ("hit", "exact"))
        per = r["grpc_ahead_hit_drafts"]
        lines.append(f"| {r['batch']} | {cells} | {al} | "
                     f"{'-' if per is None else f'{per:.2f}'} |")
    lines += ["", "Round anatomy (ms per verifier step; drafter ms per draft batch):", "",
              "| batch | round plain / in-proc / local / g1 / g2 | drafter in-proc / local "
              "/ g1 / g2 | draft wait g1 / g2 | wait share g1 / g2 | wire ms g1 (share) "
              "| codec ms | bytes/round g1 |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['plain_round_ms']:.2f} / {r['inproc_round_ms']:.2f} / "
            f"{r['stack_local_round_ms']:.2f} / {r['grpc_g1_round_ms']:.2f} / "
            f"{r['grpc_g2_round_ms']:.2f} | {r['drafter_inproc_ms']:.2f} / "
            f"{r['stack_local_drafter_ms']:.2f} / {r['grpc_g1_drafter_ms']:.2f} / "
            f"{r['grpc_g2_drafter_ms']:.2f} | {r['grpc_g1_draft_wait_ms']:.2f} / "
            f"{r['grpc_g2_draft_wait_ms']:.2f} | {100 * r['grpc_g1_wait_share']:.0f}% / "
            f"{100 * r['grpc_g2_wait_share']:.0f}% | {r['wire_ms']:.2f} "
            f"({100 * r['wire_share']:.0f}%) | {r['codec_ms']:.2f} "
            f"| {r['grpc_g1_bytes_per_round']:.0f} |")
    return "\n".join(lines) + "\n"


def placement_line(meta: dict) -> str:
    if not meta.get("pinned"):
        return "Unpinned: every process may run on every core."
    cores = "; ".join(f"{name} (pid {p['pid']}) on core {','.join(map(str, p['cores']))}"
                      + (f" at nice {p['nice']}" if p.get("nice") else "")
                      for name, p in meta["placement"].items())
    return f"Pinned (--pin, affinity read back): {cores}."


def run_batch(batch: int, prompts, models, opts, stacks, args) -> dict:
    """Every mode `args.repeats` times, ABBA order; the row of medians."""
    batch_prompts = (prompts * batch)[:batch]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            if mode in STACKS:
                runs[mode].append(run_grpc(*stacks[mode], batch_prompts, args.max_tokens))
            else:
                runs[mode].append(run_local(models, opts, batch_prompts, args.max_tokens,
                                            mode == "inproc"))
    row = summarize(batch, {m: median_run(runs[m]) for m in MODES}, args.k)
    reference = runs["plain"][0]["outputs"]
    for m in MODES:  # every run of every mode, not only the first
        row[f"lossless_{m}"] = all(r["outputs"] == reference for r in runs[m])
    row["lossless"] = all(row[f"lossless_{m}"] for m in MODES)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEMO_MODEL)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1, help="torch threads in this process")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; medians reported")
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    p.add_argument("--pin", action="store_true",
                   help="verifier and co-located modes on core 0, drafter actors on core 1")
    p.add_argument("--pin-nice", type=int, default=-10,
                   help="with --pin: every role's priority (0: unchanged)")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("CHAINSPEC_STATE_DIR", tempfile.mkdtemp(prefix="services-bench-"))
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    tok = Tokenizer.from_dir(args.model)
    prompts = [tok.encode(t) for t in PROMPTS]
    opts = LocalOptions(model_dir=args.model, num_steps=args.k, max_seqs=max(args.batch),
                        max_len=args.max_len)
    models = load_models(opts)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    stacks, rows, placement = {}, [], {}
    if args.pin:
        placement["bench"] = pin_process(VERIFIER_CORES, args.pin_nice)
    try:
        for name in STACKS:
            stacks[name] = start_stack(name, args.model, args.k, max(args.batch), args.max_len)
            if args.pin:
                for role, actor in zip(("verifier", "drafter"), stacks[name][1],
                                       strict=False):
                    placement[f"{name}.{role}"] = pin_actor(
                        actor, VERIFIER_CORES if role == "verifier" else DRAFTER_CORES,
                        args.pin_nice)
        for batch in args.batch:
            rows.append(run_batch(batch, prompts, models, opts, stacks, args))
            print(json.dumps(rows[-1], indent=1), flush=True)
    finally:
        for name in stacks:
            stack.down(namespace=f"{NS}-{name.replace('_', '-')}")
        ray.shutdown()
    meta = {"model": str(args.model), "k": args.k, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "load_average_start": load_start,
            "load_average": os.getloadavg(), "batches": args.batch,
            "threads": args.threads, "pinned": args.pin, "placement": placement,
            "host": f"{platform.processor() or platform.machine()}, "
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

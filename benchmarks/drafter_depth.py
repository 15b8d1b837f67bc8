"""What a draft round costs by the draft steps it runs (drafter-side depth, DESIGN 4.11).

    .venv/bin/python benchmarks/drafter_depth.py [--model DIR] [--k 4] [--batch 1 8 32]
        [--rounds 40] [--out benchmarks/results/drafter_depth]

The demo model's drafter (in process, this machine's device). Per batch size and depth
D: a fresh drafter whose sequences got a prompt each (all K steps), then `--rounds`
steady rounds of 2 new rows a sequence, each asking for D draft steps (steps above D
lag, and catch up in a full-depth round once past `lag_rows`: counted, and in the mean).
Depths in rotated order per repeat, so drift hits each alike. Timed: `DrafterEngine.update`.
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from chainspec.engine.draft_types import SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import DEMO_MODEL, LocalOptions, load_models

RESULTS = Path(__file__).resolve().parent / "results"


def _engine(draft, k: int, batch: int, gen: torch.Generator) -> tuple[DrafterEngine, int]:
    """A drafter holding `batch` sequences after a 48-token prompt each (all K steps)."""
    eng = DrafterEngine(draft, DrafterConfig(num_steps=k, max_seqs=batch, max_len=4096,
                                             use_graphs=torch.cuda.is_available()))
    h, vocab, prompt = draft.config.hidden_size, draft.config.vocab_size, 48
    eng.update([SeqUpdate(s, 0, tuple(torch.randint(0, vocab, (prompt,), generator=gen).tolist()),
                          torch.randn(prompt, h, generator=gen)) for s in range(batch)])
    return eng, prompt


def measure(draft, k: int, batch: int, rounds: int, repeats: int = 3, seed: int = 0) -> dict:
    """Per depth D: `rounds` consecutive rounds asking for D on a fresh drafter (so steps
    above D lag, and catch up in a full-depth round once past `lag_rows`), the depths in
    rotated order per repeat. The mean counts the catch-ups in: it is what D costs."""
    gen = torch.Generator().manual_seed(seed)
    h, vocab = draft.config.hidden_size, draft.config.vocab_size
    times: dict[int, list[float]] = {d: [] for d in range(1, k + 1)}
    catchups = {d: 0 for d in range(1, k + 1)}
    for rep in range(repeats):
        for i in range(k):
            ask = (i + rep) % k + 1
            eng, start = _engine(draft, k, batch, gen)
            for _ in range(rounds):
                ups = [SeqUpdate(s, start, tuple(torch.randint(0, vocab, (2,), generator=gen)
                                                 .tolist()), torch.randn(2, h, generator=gen),
                                 num_drafts=ask) for s in range(batch)]
                t0 = time.perf_counter()
                out = eng.update(ups)
                times[ask].append(time.perf_counter() - t0)
                catchups[ask] += len(out[0].tokens) != ask
                start += 2
    mean = {d: statistics.mean(v) * 1e3 for d, v in times.items()}
    return {"batch": batch, "k": k, "mean_ms": mean,
            "median_ms": {d: statistics.median(v) * 1e3 for d, v in times.items()},
            "rounds": {d: len(v) for d, v in times.items()}, "catchups": catchups,
            "vs_full": {d: mean[d] / mean[k] for d in mean}}


def markdown(rows: list[dict], meta: dict) -> str:
    k = rows[0]["k"]
    head = "| batch | " + " | ".join(f"D={d} ms" for d in range(1, k + 1)) + " | " + \
        " | ".join(f"D={d} / D={k}" for d in range(1, k)) + " |"
    lines = [f"# A draft round's time by its depth (demo model, {meta['device']})", "",
             f"`benchmarks/drafter_depth.py`: K={k}, rounds of 2 new rows a sequence after a "
             f"48-token prompt, one depth per run of rounds (3 repeats, rotated); mean "
             f"`DrafterEngine.update` time, catch-ups included. "
             f"{meta['cpus']} CPUs, torch {meta['torch']}, {meta['started']}.", "",
             head, "|" + "---|" * (1 + 2 * k - 1)]
    for r in rows:
        m, v = r["mean_ms"], r["vs_full"]
        lines.append(f"| {r['batch']} | " + " | ".join(f"{m[d]:.2f}" for d in range(1, k + 1)) +
                     " | " + " | ".join(f"{v[d]:.2f}" for d in range(1, k)) + " |")
    lines += ["", "Full-depth catch-ups (a lag past `lag_rows`), per batch, of the rounds "
              "asking for D = 1..K: " + "; ".join(
                  f"{r['batch']}: " + "/".join(str(r["catchups"][d]) for d in range(1, k + 1))
                  + f" of {r['rounds'][1]}" for r in rows), ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=60, help="rounds per depth and repeat")
    p.add_argument("--out", default=str(RESULTS / "drafter_depth"))
    args = p.parse_args()
    torch.set_grad_enabled(False)
    models = load_models(LocalOptions(args.model, num_steps=args.k, max_seqs=max(args.batch),
                                      max_len=2048))
    meta = {"device": "cuda" if torch.cuda.is_available() else "cpu",
            "cpus": len(__import__("os").sched_getaffinity(0)), "torch": torch.__version__,
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": platform.machine()}
    rows = []
    for b in args.batch:
        rows.append(measure(models.draft, args.k, b, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()

"""The families with windowed groups, recurrent states and latent caches (Qwen3.5,
MiMo-V2-Flash, DeepSeek-V3, Step-3.5-Flash) on tiny random checkpoints, on the device:
every verify step replayed from a CUDA graph (where the model is `graph_safe`; else the
static buffers run eagerly) equals the packed eager step from the same cache, an engine
on graphs decodes as the eager one does, and greedy speculative output equals plain
(fp32: token for token). Drafted and accepted counts are recorded, not required: random
modules accept rarely (tests/unit/families/test_family_verify_graphs.py requires some).

The checks are tests/unit/families/graph_check.py's; the checkpoints are written by
transformers (a section without it records a skip)."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import torch

from benchmarks.gpu.timing import Budget, Context, skipped

MAX_TOKENS = 14
K = 3
TOLERANCE = 1e-4  # fp32: replayed or static vs packed rows and cache values


def family_graphs_section(ctx: Context, budget: Budget) -> dict:
    if importlib.util.find_spec("transformers") is None:
        return skipped("transformers is not installed (it writes the tiny checkpoints)")
    from tests.unit.families.graph_check import FAMILIES
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            if budget.spent:
                return {"rows": rows, "budget_s": budget.seconds,
                        "skipped_sizes": list(FAMILIES[len(rows) // 2:])}
            family_rows = _family(name, Path(tmp) / name, ctx)
            rows += family_rows
            failures += [f"{r['family']} {r['mode']}: {what}" for r in family_rows
                         for what in _failed(r)]
    out = {"rows": rows, "k": K, "max_tokens": MAX_TOKENS, "dtype": "torch.float32"}
    if failures:
        out["error"] = "; ".join(failures)
    return out


@torch.inference_mode()
def _family(name: str, path: Path, ctx: Context) -> list[dict]:
    from chainspec.models.loader import load_draft_model, load_target
    from tests.unit.engine_fixtures import engine, outputs
    from tests.unit.families.graph_check import BLOCKS, CHUNK, checked, prompts, write_family
    path.mkdir(parents=True)
    write_family(name, path)
    target = load_target(path, torch.float32, ctx.device)
    draft = load_draft_model(path, torch.float32, ctx.device)
    ps = prompts(3)

    def run(spec: bool, graphs: bool):
        eng = engine(target, draft if spec else None, k=K, chunk=CHUNK, kv=BLOCKS,
                     drafter_kv=BLOCKS, max_seqs=4, sampled_drafts=False)
        check = checked(eng, use_graphs=True) if graphs else None
        if check is None:
            eng.graphs.enabled = False  # the packed eager path throughout
        tokens, result = outputs(eng, ps, MAX_TOKENS)
        return tokens, result, check

    eager, _, _ = run(spec=False, graphs=False)
    rows = []
    for mode, spec in (("plain", False), ("spec", True)):
        tokens, result, check = run(spec, graphs=True)
        stats = [c.stats for c in result.completions]
        rows.append({"family": name, "mode": mode, "graph_safe": target.graph_safe,
                     "captured": bool(check.graphs), **check.summary(),
                     "equals_eager_plain": tokens == eager,
                     "drafted": sum(s.draft_tokens for s in stats),
                     "accepted": sum(s.accepted_tokens for s in stats)})
    return rows


def _failed(row: dict) -> list[str]:
    what = []
    if not row["equals_eager_plain"]:
        what.append("output differs from eager plain decoding")
    if not row["checked_steps"]:
        what.append("no step took the static path")
    if row["hidden_max_diff"] > TOLERANCE or row["cache_max_diff"] > TOLERANCE:
        what.append(f"static/replayed step differs from packed (hidden "
                    f"{row['hidden_max_diff']:.2g}, cache {row['cache_max_diff']:.2g})")
    if not row["same_writes"]:
        what.append("the static step wrote entries the packed step did not")
    if row["captured"] and not row["replays"]:
        what.append("captured but never replayed")
    return what

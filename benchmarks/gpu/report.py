"""The GPU check's outputs: one JSON document and a markdown rendering of it. Pure
functions (tested on CPU in tests/unit/test_gpu_check.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

OUTCOMES = ("passed", "failed", "skipped", "errors", "xfailed", "xpassed")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_counts(summary: str) -> dict[str, int]:
    """Outcome counts from pytest's last summary line ("3 passed, 1 skipped in 2.1s");
    every outcome present, 0 when absent."""
    counts = dict.fromkeys(OUTCOMES, 0)
    lines = [ln for ln in summary.strip().splitlines() if ln.strip()]
    for count, outcome in _COUNT.findall(lines[-1] if lines else ""):
        key = "errors" if outcome.startswith("error") else outcome
        if key in counts:
            counts[key] = int(count)
    return counts


def document(meta: Mapping, tests: Mapping, sections: Mapping[str, Mapping]) -> dict:
    """The JSON written to gpu_check.json: run metadata, the test run, one entry per
    section (`{"rows": [...]}`, `{"skipped": why}` or `{"error": what}`)."""
    for name, sec in sections.items():
        if not ({"rows", "skipped", "error"} & set(sec)):
            raise ValueError(f"section {name!r} has no rows, skip or error: {sorted(sec)}")
    return {"meta": dict(meta), "tests": dict(tests), "sections": dict(sections),
            "ok": ok(tests, sections)}


def ok(tests: Mapping, sections: Mapping[str, Mapping]) -> bool:
    """Tests ran without failures or errors and no section raised."""
    failed = tests.get("failed", 0) or tests.get("errors", 0) or tests.get("returncode", 0) \
        not in (0, None)
    return not failed and not any("error" in s for s in sections.values())


def fmt(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def table(rows: Sequence[Mapping]) -> str:
    """A markdown table over the union of the rows' keys (first-seen order); a missing
    cell is empty."""
    if not rows:
        return "(no rows)"
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row[c]) if c in row else "" for c in columns)
                     + " |")
    return "\n".join(lines)


def markdown(doc: Mapping) -> str:
    meta, tests = doc["meta"], doc["tests"]
    out = ["# GPU check", "", f"`{meta.get('command', '')}`", ""]
    out += [f"- {k}: {fmt(v)}" for k, v in meta.items() if k != "command"]
    counts = ", ".join(f"{tests[k]} {k}" for k in OUTCOMES if tests.get(k))
    out += [f"- tests/gpu: {tests.get('skipped_run') or counts or 'nothing ran'}",
            f"- ok: {doc['ok']}", ""]
    for name, sec in doc["sections"].items():
        out += [f"## {name}", ""]
        if "skipped" in sec:
            out += [f"skipped: {sec['skipped']}", ""]
            continue
        if "error" in sec:
            out += [f"error: {sec['error']}", ""]
            continue
        out += [table(sec["rows"]), ""]
        out += [f"- {k}: {fmt(v)}" for k, v in sec.items() if k != "rows"]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def write(doc: Mapping, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    js.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    md.write_text(markdown(doc))
    return js, md

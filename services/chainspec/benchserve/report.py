"""The sweep's outputs: one JSON file (everything) and a markdown table per run, with
spec/plain ratios when both ran."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _trio(dist: dict[str, float | None]) -> str:
    return " / ".join(_f(dist[p], 0 if (dist[p] or 0) >= 100 else 1)
                      for p in ("p50", "p90", "p99"))


HEADER = ("| load | req/s | out tok/s | goodput req/s | TTFT ms p50/p90/p99 | "
          "TPOT ms p50/p90/p99 | ITL ms p50/p90/p99 | e2e ms p50/p90/p99 | errors | AL |")


def point_row(p: dict[str, Any]) -> str:
    spec = p.get("speculative") or {}
    return (f"| {p['load']['label']} | {_f(p['request_throughput'], 2)} | "
            f"{_f(p['output_throughput'])} | {_f(p['goodput'], 2)} | {_trio(p['ttft_ms'])} | "
            f"{_trio(p['tpot_ms'])} | {_trio(p['itl_ms'])} | {_trio(p['e2e_ms'])} | "
            f"{p['errors']}{' (all: failed)' if p.get('failed') else ''} | "
            f"{_f(spec.get('acceptance_length'), 2)} |")


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# chainspec bench serve: {report['model']} at {report['base_url']}", "",
             f"Command: `{report['command']}`", "",
             f"Dataset {report['dataset']}, {report['requests_per_point']} requests per "
             f"point; SLOs {report['slo'] or 'none'}. AL: acceptance length (tokens per "
             "drafted round) from the verifiers' spec-decode counters over the point.", ""]
    if report.get("error"):
        lines += [f"**The sweep stopped early**: {report['error']}", ""]
    for mode, points in report["runs"].items():
        lines += [f"## {mode}", "", HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
        lines += [point_row(p) for p in points] + [""]
    if {"spec", "plain"} <= set(report["runs"]):
        lines += ["## spec / plain", "", "| load | out tok/s ratio | TPOT p50 ratio | "
                  "e2e p50 ratio |", "|---|---|---|---|"]
        # NOTE: a sweep that stopped early has fewer plain points than spec ones
        for s, p in zip(report["runs"]["spec"], report["runs"]["plain"], strict=False):
            lines.append(f"| {s['load']['label']} | "
                         f"{_ratio(s['output_throughput'], p['output_throughput'])} | "
                         f"{_ratio(s['tpot_ms']['p50'], p['tpot_ms']['p50'])} | "
                         f"{_ratio(s['e2e_ms']['p50'], p['e2e_ms']['p50'])} |")
        lines.append("")
    for name in report.get("plots", ()):
        lines += [f"![{Path(name).stem}]({name})", ""]
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def write(report: dict[str, Any], out_dir: Path, name: str = "serve") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown(report))
    return paths

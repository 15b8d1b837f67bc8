"""PNG plots of a sweep (matplotlib, imported here only): throughput vs latency per run,
TTFT/TPOT percentiles by load, per-position acceptance, and drafters over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STYLES = {"spec": ("tab:blue", "-"), "plain": ("tab:orange", "--"), "run": ("tab:gray", "-")}
DPI = 90


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_all(report: dict[str, Any], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    paths = [throughput_latency(plt, report, out_dir / "throughput_latency.png"),
             percentiles(plt, report, out_dir / "latency_percentiles.png")]
    if any(p.get("speculative", {}).get("per_position") for p in report["runs"].get("spec", [])):
        paths.append(acceptance(plt, report, out_dir / "acceptance_per_position.png"))
    if report.get("drafters_over_time"):
        paths.append(drafters(plt, report, out_dir / "drafters_over_time.png"))
    return paths


def drafters_png(report: dict[str, Any], path: Path) -> Path:
    """The drafter timeline alone (`drafters_over_time`, load points shaded from `runs`)."""
    return drafters(_pyplot(), report, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def throughput_latency(plt, report: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in ((axes[0], "tpot_ms", "TPOT p50 (ms)"),
                           (axes[1], "e2e_ms", "e2e latency p50 (ms)")):
        for mode, points in report["runs"].items():
            color, ls = STYLES.get(mode, STYLES["run"])
            for kind, marker in (("concurrency", "o"), ("rate", "s")):  # one curve per shape
                curve = [p for p in points if p["load"]["kind"] == kind]
                if curve:
                    _curve(ax, curve, key, color, ls, marker, f"{mode} ({kind})")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # every point failed: nothing to label
            ax.legend(fontsize=8)
    fig.suptitle("throughput vs latency", fontsize=10)
    return _save(plt, fig, path)


def _curve(ax, points: list[dict[str, Any]], key: str, color: str, ls: str, marker: str,
           label: str) -> None:
    points = [p for p in points if p[key]["p50"] is not None]  # a failed point: no figures
    if not points:
        return
    xs = [p["output_throughput"] for p in points]
    ys = [p[key]["p50"] for p in points]
    ax.plot(xs, ys, ls, marker=marker, color=color, label=label)
    for x, y, p in zip(xs, ys, points, strict=True):
        ax.annotate(p["load"]["label"], (x, y), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")


def percentiles(plt, report: dict[str, Any], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key in ((axes[0], "ttft_ms"), (axes[1], "tpot_ms")):
        for mode, points in report["runs"].items():
            color, ls = STYLES.get(mode, STYLES["run"])
            labels = [p["load"]["label"] for p in points]
            for pct, marker in (("p50", "o"), ("p90", "s"), ("p99", "^")):
                ax.plot(labels, [_nan(p[key][pct]) for p in points], ls, marker=marker,
                        color=color, alpha=0.9 if pct == "p50" else 0.55,
                        label=f"{mode} {pct}")
        ax.set_xlabel("load")
        ax.set_ylabel(key.replace("_ms", " (ms)").upper())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle("latency percentiles by load", fontsize=10)
    return _save(plt, fig, path)


def _nan(value: float | None) -> float:
    """A failed point's missing figure as a gap in the line."""
    return float("nan") if value is None else value


def acceptance(plt, report: dict[str, Any], path: Path) -> Path:
    points = [p for p in report["runs"]["spec"] if p.get("speculative", {}).get("per_position")]
    k = max(len(p["speculative"]["per_position"]) for p in points)
    width = 0.8 / len(points)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, p in enumerate(points):
        rates = p["speculative"]["per_position"]
        ax.bar([j + i * width for j in range(len(rates))], rates, width,
               label=f"{p['load']['label']} (AL {p['speculative']['acceptance_length']:.2f})")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(k)], [f"pos {j}" for j in range(k)])
    ax.set_ylabel("accepted / drafted rounds")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    ax.set_title("per-position acceptance (spec run)", fontsize=10)
    return _save(plt, fig, path)


def drafters(plt, report: dict[str, Any], path: Path) -> Path:
    ts, ns = zip(*report["drafters_over_time"], strict=True)
    fig, ax = plt.subplots(figsize=(7, 2.8))
    ax.step(ts, ns, where="post", color="black")
    for mode, points in report["runs"].items():
        color, _ = STYLES.get(mode, STYLES["run"])
        for p in points:
            ax.axvspan(p["t_start_s"], p["t_end_s"], color=color, alpha=0.15, lw=0)
            ax.axvline(p["t_start_s"], color=color, lw=0.6, alpha=0.6)
            label = p.get("load", {}).get("label")
            if label:
                ax.text(p["t_start_s"], max(ns) + 0.25, f" {label}", fontsize=7,
                        color=color, va="center")
    ax.set_xlabel("time (s); shaded: load points (blue spec, orange plain)")
    ax.set_ylabel("drafters")
    ax.set_ylim(-0.1, max(ns) + 0.5)
    ax.grid(alpha=0.3)
    ax.set_title("drafters connected over the run", fontsize=10)
    return _save(plt, fig, path)

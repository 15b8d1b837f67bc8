"""benchmarks/gpu_check.py on a CPU machine: without CUDA it prints one line and exits 0;
the CPU dry run drives every section's code on tiny shapes and writes a well-formed
report; the report helpers (pytest counts, tables, the JSON document) are checked by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.report import document, markdown, pytest_counts, table

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # CUDA hidden: on a GPU machine too this checks the no-CUDA path and a CPU dry run
    env = {**os.environ, "PYTHONPATH": "services:.", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_without_cuda_one_line_exit_0(tmp_path):
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA" in lines[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_cpu_dry_run_runs_every_section(tmp_path):
    proc = _run("--force-cpu-dry-run", "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["ok"] and doc["meta"]["dry_run"]
    secs = doc["sections"]
    names = {"draft_round", "verify_step", "attention", "small_kernels", "family_graphs",
             "moe", "tp_step"}
    assert set(secs) == names
    for name in names:
        assert "rows" in secs[name] and secs[name]["rows"], (name, secs[name])
    # graph and eager rounds draft the same tokens; the kernel matches its reference
    assert all(r["same_drafts"] for r in secs["draft_round"]["rows"])
    assert [r["batch"] for r in secs["verify_step"]["rows"]] == [1, 2]
    assert {r["case"] for r in secs["attention"]["rows"]} == {"decode", "verify"}
    assert all(r["max_abs_diff"] < 1e-4 for r in secs["attention"]["rows"])
    assert "## attention" in (tmp_path / "gpu_check.md").read_text()
    # the fused MoE kernel matches its reference at every row count
    moe = secs["moe"]["rows"]
    assert {r["case"] for r in moe} == {"decode", "verify", "prefill"}
    assert all(r["max_rel_diff"] < 1e-5 and r["experts_hit"] > 0 for r in moe)
    # each family's static steps equal packed ones, and spec equals plain (CPU: eager)
    fam = secs["family_graphs"]["rows"]
    assert {(r["family"], r["mode"]) for r in fam} == {
        (f, m) for f in ("qwen3_5", "mimo_v2_flash", "deepseek_v3", "step3", "qwen3_next")
        for m in ("plain", "spec")}
    assert all(r["equals_eager_plain"] and r["same_writes"] and r["checked_steps"]
               for r in fam)
    # the TP=1 baseline: one row per (layers, sequences), K + 1 rows per sequence
    tp = secs["tp_step"]["rows"]
    assert [(r["tp"], r["layers"], r["rows"]) for r in tp] == [(1, 2, 4), (1, 2, 8)]
    assert all(0 < r["lm_head_ms"] < r["step_ms"] and r["per_layer_ms"] > 0 for r in tp)


def test_pytest_counts_reads_the_summary_line():
    out = "....s.F\nFAILED tests/gpu/x.py::t - assert 1\n" \
          "1 failed, 5 passed, 1 skipped, 2 errors in 3.21s\n"
    got = pytest_counts(out)
    assert (got["passed"], got["failed"], got["skipped"], got["errors"]) == (5, 1, 1, 2)
    assert pytest_counts("1 error in 0.1s")["errors"] == 1
    assert pytest_counts("") == dict.fromkeys(got, 0)


def test_table_unions_columns_in_first_seen_order():
    text = table([{"batch": 1, "ms": 0.12345}, {"batch": 2, "speedup": 250.4, "ms": 1.5}])
    lines = text.splitlines()
    assert lines[0] == "| batch | ms | speedup |"
    assert lines[2] == "| 1 | 0.123 |  |"
    assert lines[3] == "| 2 | 1.5 | 250 |"
    assert table([]) == "(no rows)"


def test_document_shape_and_ok():
    tests = {"passed": 3, "failed": 0, "errors": 0, "returncode": 0}
    secs = {"a": {"rows": [{"x": 1}]}, "b": {"skipped": "not on main yet"}}
    doc = document({"command": "python3 x", "device": "H200"}, tests, secs)
    assert set(doc) == {"meta", "tests", "sections", "ok"} and doc["ok"]
    json.dumps(doc)  # serialisable
    md = markdown(doc)
    assert "skipped: not on main yet" in md and "| x |" in md
    assert not document({}, {**tests, "failed": 1}, secs)["ok"]
    assert not document({}, {**tests, "returncode": 2}, secs)["ok"]
    assert not document({}, tests, {"a": {"error": "boom"}})["ok"]
    with pytest.raises(ValueError):
        document({}, tests, {"a": {"seconds": 1.0}})

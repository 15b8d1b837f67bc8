"""benchmarks/drafter_depth.py on a tiny drafter: every depth is timed for its rounds, a
lag past the bound is counted as a catch-up, and the table reads the figures back."""

from benchmarks.drafter_depth import markdown, measure
from tests.unit.tiny_models import tiny_draft_model


def test_every_depth_timed_and_catch_ups_counted():
    # 40 rounds of 2 rows: a lagging step passes lag_rows (64) once per run of rounds
    row = measure(tiny_draft_model(2, seed=1), k=2, batch=2, rounds=40, repeats=1)
    assert row["rounds"] == {1: 40, 2: 40}
    assert row["catchups"] == {1: 1, 2: 0}
    assert row["vs_full"][2] == 1.0 and all(v > 0 for v in row["mean_ms"].values())
    md = markdown([row], {"device": "cpu", "cpus": 2, "torch": "t", "started": "s"})
    assert "| 2 | " in md and "2: 1/0 of 40" in md

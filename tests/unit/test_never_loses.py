"""benchmarks/never_loses.py's arithmetic: a point's best configuration, the ratio the
issue's bar is on, and the verdicts, on hand-made request results."""

from benchmarks.never_loses import row, verdicts
from chainspec.benchserve.client import RequestResult
from chainspec.benchserve.config import LoadKind, LoadPoint


def _run(tokens: int, seconds: float, tpot_s: float, depths=(0, 0, 0, 0, 0, 0)) -> dict:
    """One repeat: two requests of `tokens` each over `seconds`; `depths`: the verifier
    counters read around it (depths 0..4, then resyncs)."""
    results = [RequestResult(ok=True, start_s=0.0, end_s=seconds, ttft_s=0.0,
                             output_tokens=tokens) for _ in range(2)]
    for r in results:
        r.end_s = tpot_s * (tokens - 1)
    return {"results": results, "duration_s": seconds, "depths": list(depths)}


def _point(value: float, seconds: dict[str, float]) -> dict:
    runs = {n: [_run(50, s, s / 100, (1, 0, 0, 2, 7, 3) if n == "adaptive" else (0,) * 6)]
            for n, s in seconds.items()}
    return row(LoadPoint(LoadKind.CONCURRENCY, value), runs)


def test_ratio_is_against_the_better_of_plain_and_the_best_fixed_k():
    r = _point(1, {"plain": 2.0, "k1": 1.6, "k2": 1.0, "k3": 1.25, "k4": 1.1,
                   "adaptive": 1.05})
    assert r["best_fixed"] == "k2"
    assert r["tokens_per_s"]["k2"] == 100.0  # 2 x 50 tokens in 1 s
    assert r["adaptive_over_best"] == round(1.0 / 1.05, 3)
    assert r["adaptive_over_plain"] == round(2.0 / 1.05, 3)
    assert r["adaptive_depths"] == [1, 0, 0, 2, 7]
    assert r["resyncs"]["adaptive"] == 3 and r["resyncs"]["k4"] == 0
    assert r["adaptive_mean_depth"] == round((3 * 2 + 4 * 7) / 10, 3)
    # plain the best: the bar is on plain
    r = _point(64, {"plain": 1.0, "k1": 1.5, "k2": 1.6, "k3": 2.0, "k4": 2.1,
                    "adaptive": 1.02})
    assert r["adaptive_over_best"] == round(1.0 / 1.02, 3)


def test_verdicts_apply_each_bar():
    good = _point(1, {"plain": 2.0, "k1": 1.6, "k2": 1.0, "k3": 1.2, "k4": 1.1,
                      "adaptive": 1.02})
    assert verdicts([good]) == {"every_point_ge_0.97": True,
                                "tpot_p50_never_worse_than_plain": True,
                                "c1_within_3pct_of_best_k": True}
    slow = _point(1, {"plain": 2.0, "k1": 1.6, "k2": 1.0, "k3": 1.2, "k4": 1.1,
                      "adaptive": 1.05})
    v = verdicts([slow])
    assert not v["every_point_ge_0.97"] and not v["c1_within_3pct_of_best_k"]
    worse = _point(4, {"plain": 1.0, "k1": 1.6, "k2": 1.5, "k3": 1.2, "k4": 1.1,
                       "adaptive": 2.5})
    assert not verdicts([worse])["tpot_p50_never_worse_than_plain"]

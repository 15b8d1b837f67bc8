"""`chainspec bench serve`'s maths on synthetic timings: percentiles, TPOT, throughput,
goodput, errors, Poisson arrivals, counter deltas, and the markdown it writes."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from chainspec.benchserve.client import RequestResult
from chainspec.benchserve.config import SLO, LoadKind, LoadPoint
from chainspec.benchserve.dataset import random_tokens
from chainspec.benchserve.load import poisson_offsets
from chainspec.benchserve.report import markdown
from chainspec.benchserve.stack import SpecCounters, parse_counters
from chainspec.benchserve.stats import distribution_ms, summarize
from chainspec.cli import build_parser


def result(start: float, ttft: float, gaps: list[float], tokens: int | None = None,
           error: str | None = None) -> RequestResult:
    end = start + ttft + sum(gaps)
    return RequestResult(ok=error is None, error=error, start_s=start, end_s=end,
                         ttft_s=ttft, itl_s=list(gaps),
                         output_tokens=len(gaps) + 1 if tokens is None else tokens,
                         prompt_tokens=10)


def test_percentiles_interpolate_linearly_in_ms() -> None:
    d = distribution_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d["p50"] == pytest.approx(50.5) and d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01) and d["mean"] == pytest.approx(50.5)
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    r = result(0.0, 0.2, [0.05, 0.05, 0.05], tokens=7)  # 3 chunks carried 6 tokens
    assert r.e2e_s == pytest.approx(0.35)
    assert r.tpot_s == pytest.approx(0.15 / 6)
    assert result(0.0, 0.2, [], tokens=1).tpot_s is None


def test_summary_throughput_latency_and_errors() -> None:
    ok = [result(i * 0.1, 0.1 + 0.01 * i, [0.02] * 9) for i in range(10)]  # 10 tokens each
    bad = [result(0.0, 0.0, [], tokens=0, error="http 500")] * 3
    s = summarize(ok + bad, duration_s=2.0, slo=SLO())
    assert (s["requests"], s["completed"], s["errors"]) == (13, 10, 3)
    assert s["error_kinds"] == {"http 500": 3}
    assert s["request_throughput"] == pytest.approx(5.0)
    assert s["output_throughput"] == pytest.approx(50.0)
    assert s["total_token_throughput"] == pytest.approx(100.0)  # + 10 prompt tokens each
    ttfts = [100 + 10 * i for i in range(10)]
    assert s["ttft_ms"]["p50"] == pytest.approx(float(np.percentile(ttfts, 50)))
    assert s["ttft_ms"]["p99"] == pytest.approx(float(np.percentile(ttfts, 99)))
    assert s["itl_ms"]["p50"] == pytest.approx(20.0) and s["tpot_ms"]["p90"] == pytest.approx(20)
    assert s["e2e_ms"]["mean"] == pytest.approx(statistics.mean(t + 180 for t in ttfts))
    assert s["goodput"] is None  # no SLO given


def test_goodput_counts_completed_requests_within_every_slo() -> None:
    rs = [result(0, 0.1, [0.01] * 4), result(0, 0.3, [0.01] * 4),  # TTFT 100 / 300 ms
          result(0, 0.1, [0.05] * 4), result(0, 0.1, [], error="ReadTimeout")]
    s = summarize(rs, 2.0, SLO.parse(["ttft:200", "tpot:20"]))
    assert s["goodput"] == pytest.approx(0.5)  # only the first: 1 request / 2 s
    assert summarize(rs, 2.0, SLO(e2e_ms=1000))["goodput"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="ttft:MS"):
        SLO.parse(["latency:3"])


def test_poisson_arrivals_have_the_requested_rate_and_are_reproducible() -> None:
    offsets = poisson_offsets(4000, 8.0, seed=1)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert len(offsets) / offsets[-1] == pytest.approx(8.0, rel=0.05)
    gaps = np.diff(offsets)
    assert np.std(gaps) == pytest.approx(np.mean(gaps), rel=0.1)  # exponential: sd = mean
    assert poisson_offsets(10, 8.0, 1) == offsets[:10]


def test_random_dataset_lengths_stay_in_range() -> None:
    data = random_tokens(100, 40, 20, 0.25, 200, seed=0)
    assert all(30 <= len(r.prompt) <= 50 and 15 <= r.max_tokens <= 25 for r in data.requests)
    assert all(0 <= t < 100 for r in data.requests for t in r.prompt)
    assert len({len(r.prompt) for r in data.requests}) > 5


def test_load_points_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        LoadPoint(LoadKind.CONCURRENCY, 1.5)
    with pytest.raises(ValueError):
        LoadPoint(LoadKind.RATE, 0)
    assert LoadPoint(LoadKind.RATE, 2.5).label == "2.5 req/s"


EXPOSITION = """# TYPE chainspec_spec_decode_num_drafts_total counter
chainspec_spec_decode_num_drafts_total{{model="m"}} {d}
# TYPE chainspec_spec_decode_num_draft_tokens_total counter
chainspec_spec_decode_num_draft_tokens_total{{model="m"}} {t}
# TYPE chainspec_spec_decode_num_accepted_tokens_total counter
chainspec_spec_decode_num_accepted_tokens_total{{model="m"}} {a}
# TYPE chainspec_spec_decode_num_accepted_tokens_per_pos_total counter
chainspec_spec_decode_num_accepted_tokens_per_pos_total{{model="m",position="0"}} {p0}
chainspec_spec_decode_num_accepted_tokens_per_pos_total{{model="m",position="1"}} {p1}
"""


def test_spec_figures_are_deltas_summed_over_verifiers() -> None:
    before = parse_counters([EXPOSITION.format(d=10, t=20, a=5, p0=4, p1=1)])
    after = parse_counters([EXPOSITION.format(d=30, t=60, a=35, p0=16, p1=9),
                            EXPOSITION.format(d=20, t=40, a=10, p0=7, p1=3)])
    assert after == SpecCounters(50, 100, 45, (23, 12))
    fig = after.minus(before).figures()
    assert fig["acceptance_length"] == pytest.approx(1 + 40 / 40)
    assert fig["per_position"] == pytest.approx([19 / 40, 11 / 40])
    assert SpecCounters().figures()["acceptance_length"] is None


def test_markdown_has_one_row_per_point_and_spec_plain_ratios() -> None:
    s = summarize([result(0, 0.1, [0.02] * 9)], 1.0, SLO())
    point = {"load": {"kind": "concurrency", "value": 1, "label": "c=1"}, **s,
             "speculative": {"acceptance_length": 2.5}}
    slow = {**point, "output_throughput": 5.0}
    text = markdown({"model": "m", "base_url": "u", "command": "c", "dataset": "d",
                     "requests_per_point": 1, "slo": {},
                     "runs": {"spec": [point], "plain": [slow]}})
    assert text.count("| c=1 |") == 3 and "| 2.00x |" in text and "| 2.50 |" in text


def test_bench_keeps_its_flags_and_gains_serve() -> None:
    parser, _ = build_parser()
    old = parser.parse_args(["bench", "--json", "-k", "3"])
    assert (old.bench_mode, old.json, old.stack_num_speculative_tokens, old.prompts) == (
        None, True, 3, 20)
    new = parser.parse_args(["bench", "serve", "--concurrency", "1,2,4,8", "--compare-plain",
                             "--goodput", "ttft:500"])
    assert new.bench_mode == "serve" and new.concurrency == [1, 2, 4, 8]
    assert new.compare_plain and new.goodput == ["ttft:500"]

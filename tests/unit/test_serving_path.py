"""benchmarks/serving_path.py's window arithmetic: tokens the client had by a moment, and
the verifier's mean batch between two snapshots."""

from __future__ import annotations

from benchmarks.serving_path import occupancy, tokens_by
from chainspec.benchserve.client import RequestResult


def test_tokens_by_spreads_each_requests_tokens_over_its_chunks() -> None:
    # chunks at 11, 12, 13, 14 (start 10, TTFT 1): 8 tokens, 2 a chunk
    spec = RequestResult(ok=True, start_s=10.0, ttft_s=1.0, itl_s=[1.0, 1.0, 1.0],
                         output_tokens=8)
    plain = RequestResult(ok=True, start_s=12.0, ttft_s=0.5, itl_s=[0.5], output_tokens=2)
    waiting = RequestResult(ok=True, start_s=12.0)  # no chunk yet: nothing received
    assert tokens_by([spec, plain, waiting], 10.5) == 0
    assert tokens_by([spec, plain, waiting], 12.0) == 4  # a chunk at t counts
    assert tokens_by([spec, plain, waiting], 12.9) == 4 + 1
    assert tokens_by([spec, plain, waiting], 20.0) == 8 + 2


def test_occupancy_counts_verify_rounds_and_scheduled_prefills() -> None:
    def snap(steps, rounds, scheduled, step_s):
        return {"steps": {"steps": steps, "rounds": rounds, "scheduled": scheduled,
                          "step_s": step_s, "tokens": 0.0}}
    # 10 steps ran 70 verify rounds and the final prefill chunks of 10 new requests
    got = occupancy(snap(10, 30, 2, 1.0), snap(20, 100, 12, 1.5))
    assert got == {"verifier_steps": 10, "step_s": 0.5, "mean_batch": 8.0}
    assert occupancy(snap(5, 7, 1, 0.0), snap(5, 7, 1, 0.0))["mean_batch"] == 0.0

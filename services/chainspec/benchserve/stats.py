"""One load point's figures from its request results: latency percentiles, throughput,
goodput under the SLOs, and errors. Pure functions over timings (unit-tested)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from chainspec.benchserve.client import RequestResult
from chainspec.benchserve.config import SLO

PERCENTILES = (50, 90, 99)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (linear interpolation, numpy's default);
    None for each when there are no values."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    out = {"mean": float(ms.mean())}
    out.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def meets(result: RequestResult, slo: SLO) -> bool:
    """A completed request within every limit the SLO sets (a missing TPOT -- one output
    token -- passes a TPOT limit)."""
    if not result.ok:
        return False
    checks = ((slo.ttft_ms, result.ttft_s), (slo.tpot_ms, result.tpot_s),
              (slo.e2e_ms, result.e2e_s))
    return all(limit is None or value is None or value * 1e3 <= limit
               for limit, value in checks)


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The point's report entry (without load or speculation fields)."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens or 0 for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "requests": len(results),
        "completed": len(done),
        "errors": len(results) - len(done),
        "failed": not done,  # every request of the point failed: no figures
        "error_kinds": dict(Counter(r.error for r in results if not r.ok)),
        "duration_s": duration_s,
        "output_tokens": out_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(out_tokens + in_tokens),
        "goodput": per_s(sum(meets(r, slo) for r in done)) if slo.as_dict() else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([g for r in done for g in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
    }

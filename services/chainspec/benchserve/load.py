"""The two load shapes: a fixed number of requests in flight, or open-loop Poisson
arrivals. Either sends the given requests once and returns their results in order."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import httpx

from chainspec.benchserve.client import RequestResult, send
from chainspec.benchserve.config import LoadKind, LoadPoint
from chainspec.benchserve.dataset import BenchRequest

OnDone = Callable[[RequestResult], None]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of `n` Poisson arrivals at `rate` per second; the
    first request goes at once."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


async def run_point(client: httpx.AsyncClient, model: str, point: LoadPoint,
                    requests: list[BenchRequest], seed: int,
                    on_done: OnDone = lambda r: None) -> tuple[list[RequestResult], float]:
    """(results, duration_s): duration runs from the first send to the last answer."""
    start = time.perf_counter()
    if point.kind is LoadKind.CONCURRENCY:
        results = await _closed_loop(client, model, int(point.value), requests, on_done)
    else:
        results = await _open_loop(client, model, point.value, requests, seed, on_done)
    end = max((r.end_s for r in results), default=start)
    return results, end - start


async def _closed_loop(client, model, concurrency: int, requests: list[BenchRequest],
                       on_done: OnDone) -> list[RequestResult]:
    results: list[RequestResult | None] = [None] * len(requests)
    queue = iter(range(len(requests)))

    async def worker() -> None:
        for i in queue:  # NOTE: one shared iterator: each index goes to one worker
            results[i] = await send(client, requests[i], model)
            on_done(results[i])

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return results  # type: ignore[return-value]


async def _open_loop(client, model, rate: float, requests: list[BenchRequest], seed: int,
                     on_done: OnDone) -> list[RequestResult]:
    t0 = time.perf_counter()

    async def arrive(offset: float, req: BenchRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        result = await send(client, req, model)
        on_done(result)
        return result

    offsets = poisson_offsets(len(requests), rate, seed)
    return list(await asyncio.gather(*(arrive(o, r) for o, r in zip(offsets, requests,
                                                                     strict=True))))

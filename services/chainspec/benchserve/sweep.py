"""A sweep: every load point in turn against one endpoint, with speculation figures from
the stack's counters around each point; `compare_plain` repeats it with the drafters
scaled to 0 and then restores them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from chainspec.benchserve import stack
from chainspec.benchserve.client import send
from chainspec.benchserve.config import SweepConfig
from chainspec.benchserve.dataset import Dataset
from chainspec.benchserve.load import run_point
from chainspec.benchserve.progress import Progress
from chainspec.benchserve.stats import summarize

SPEC, PLAIN = "spec", "plain"


@dataclass(frozen=True)
class StackControl:
    """How to reach the stack behind the endpoint for scaling (`chainspec scale` flags)."""

    args: tuple[str, ...] = ()


async def run_sweep(cfg: SweepConfig, data: Dataset, compare_plain: bool,
                    control: StackControl) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits,
                                 timeout=cfg.timeout_s) as client:
        model = cfg.model or await _first_model(client)
        drafters = await stack.drafters(client)
        if compare_plain and not drafters:
            raise ValueError("--compare-plain needs a chainspec stack with drafters "
                             f"(the gateway at {cfg.base_url} reports {drafters})")
        t0 = time.perf_counter()
        sampler = stack.DrafterSampler(client, t0)
        if drafters is not None:
            sampler.start()
        runs: dict[str, list[dict[str, Any]]] = {}
        try:
            first = SPEC if drafters else PLAIN if drafters == 0 else "run"
            runs[first] = await _points(client, model, cfg, data, drafters is not None, t0)
            if compare_plain:  # NOTE: an autoscaled stack gets its policy back after
                restore = await stack.autoscale_spec(list(control.args)) or drafters
                await stack.scale_drafters(client, 0, list(control.args))
                try:
                    runs[PLAIN] = await _points(client, model, cfg, data, True, t0)
                finally:
                    await stack.scale_drafters(client, restore, list(control.args))
            await asyncio.sleep(cfg.idle_tail_s)  # the timeline goes on (autoscaling's drain)
        finally:
            await sampler.stop()
    return {"model": model, "chainspec": drafters is not None, "drafters": drafters,
            "runs": runs, "drafters_over_time": sampler.samples}


async def _first_model(client: httpx.AsyncClient) -> str:
    r = (await client.get("/v1/models")).raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError("the endpoint lists no models (/v1/models); pass --model-name")
    return data[0]["id"]


async def _points(client, model: str, cfg: SweepConfig, data: Dataset, chainspec: bool,
                  t0: float) -> list[dict[str, Any]]:
    """Each point's summary; `t_start_s`/`t_end_s` are seconds after `t0`."""
    for req in data.take(cfg.warmup_requests):
        await send(client, req, model)
    out = []
    for i, point in enumerate(cfg.points):
        requests = data.take(cfg.requests_per_point)
        before = await stack.spec_counters(client) if chainspec else None
        progress = Progress(f"{await _mode(client, chainspec)} {point.label}", len(requests))
        t_start = time.perf_counter() - t0
        results, duration = await run_point(client, model, point, requests, cfg.seed + i,
                                            progress)
        progress.close()
        entry = {"load": {"kind": point.kind.value, "value": point.value,
                          "label": point.label}, **summarize(results, duration, cfg.slo),
                 "t_start_s": round(t_start, 2), "t_end_s": round(time.perf_counter() - t0, 2)}
        if before is not None:
            after = await stack.spec_counters(client)
            entry["speculative"] = after.minus(before).figures()
        out.append(entry)
    return out


async def _mode(client: httpx.AsyncClient, chainspec: bool) -> str:
    if not chainspec:
        return "run"
    return SPEC if await stack.drafters(client) else PLAIN


def run(cfg: SweepConfig, data: Dataset, compare_plain: bool = False,
        control: StackControl = StackControl()) -> dict[str, Any]:
    return asyncio.run(run_sweep(cfg, data, compare_plain, control))

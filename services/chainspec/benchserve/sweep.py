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
PREFLIGHT_TIMEOUT_S = 30.0  # the longest wait for /v1/models before any load


@dataclass(frozen=True)
class StackControl:
    """How to reach the stack behind the endpoint for scaling (`chainspec scale` flags)."""

    args: tuple[str, ...] = ()


async def run_sweep(cfg: SweepConfig, data: Dataset, compare_plain: bool,
                    control: StackControl) -> dict[str, Any]:
    """Every point's figures; a sweep that stops early (the server or the stack lost)
    returns the points it finished and `error`, one line saying why."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits,
                                 timeout=cfg.timeout_s) as client:
        model, drafters, restore = await preflight(client, cfg, compare_plain, control)
        t0 = time.perf_counter()
        sampler = stack.DrafterSampler(client, t0)
        if drafters is not None:
            sampler.start()
        runs: dict[str, list[dict[str, Any]]] = {}
        error = None
        try:
            first = SPEC if drafters else PLAIN if drafters == 0 else "run"
            await _points(client, model, cfg, data, drafters is not None, t0,
                          runs.setdefault(first, []))
            if compare_plain:  # NOTE: an autoscaled stack gets its policy back after
                await stack.scale_drafters(client, 0, list(control.args))
                try:
                    await _points(client, model, cfg, data, True, t0, runs.setdefault(PLAIN, []))
                finally:
                    await stack.scale_drafters(client, restore, list(control.args))
            await asyncio.sleep(cfg.idle_tail_s)  # the timeline goes on (autoscaling's drain)
        except (httpx.HTTPError, RuntimeError, OSError, ValueError) as e:
            error = _one_line(e)
        finally:
            await sampler.stop()
    return {"model": model, "chainspec": drafters is not None, "drafters": drafters,
            "runs": runs, "drafters_over_time": sampler.samples, "error": error}


async def preflight(client: httpx.AsyncClient, cfg: SweepConfig, compare_plain: bool,
                    control: StackControl) -> tuple[str, int | None, int | str | None]:
    """Before any load: (model, drafters the gateway reports or None, what to scale the
    drafters back to). ValueError, one line, when the endpoint does not answer or serve
    the model, or the stack named for scaling is not found."""
    models = await _models(client, cfg)
    if cfg.model is not None and models and cfg.model not in models:
        raise ValueError(f"--model-name {cfg.model!r} is not served at {cfg.base_url} "
                         f"(it lists {', '.join(models)})")
    if cfg.model is None and not models:
        raise ValueError("the endpoint lists no models (/v1/models); pass --model-name")
    drafters = await stack.drafters(client)
    if compare_plain and not drafters:
        raise ValueError("--compare-plain needs a chainspec stack with drafters "
                         f"(the gateway at {cfg.base_url} reports {drafters})")
    restore = None
    if compare_plain or control.args:  # the stack `chainspec scale` would act on
        try:
            restore = await stack.autoscale_spec(list(control.args)) or drafters
        except RuntimeError as e:
            raise ValueError(f"cannot find the stack to scale: {e}") from None
    return cfg.model or models[0], drafters, restore


async def _models(client: httpx.AsyncClient, cfg: SweepConfig) -> list[str]:
    try:
        r = await client.get("/v1/models", timeout=min(cfg.timeout_s, PREFLIGHT_TIMEOUT_S))
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {cfg.base_url}: {_one_line(e)}") from None
    if r.status_code in (401, 403):
        raise ValueError(f"{cfg.base_url} refused GET /v1/models with HTTP {r.status_code} "
                         "(check --api-key)")
    try:
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data") or []]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{cfg.base_url} is not an OpenAI-compatible server (GET "
                         f"/v1/models answered HTTP {r.status_code})") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def _points(client, model: str, cfg: SweepConfig, data: Dataset, chainspec: bool,
                  t0: float, out: list[dict[str, Any]]) -> None:
    """Each point's summary, appended to `out` as it ends (a sweep that stops keeps the
    points before); `t_start_s`/`t_end_s` are seconds after `t0`."""
    for req in data.take(cfg.warmup_requests):
        await send(client, req, model)
    for i, point in enumerate(cfg.points):
        requests = data.take(cfg.requests_per_point)
        before = await _counters(client) if chainspec else None
        progress = Progress(f"{await _mode(client, chainspec)} {point.label}", len(requests))
        t_start = time.perf_counter() - t0
        results, duration = await run_point(client, model, point, requests, cfg.seed + i,
                                            progress)
        progress.close()
        entry = {"load": {"kind": point.kind.value, "value": point.value,
                          "label": point.label}, **summarize(results, duration, cfg.slo),
                 "t_start_s": round(t_start, 2), "t_end_s": round(time.perf_counter() - t0, 2)}
        after = await _counters(client) if before is not None else None
        if after is not None:
            entry["speculative"] = after.minus(before).figures()
        out.append(entry)


async def _counters(client: httpx.AsyncClient) -> stack.SpecCounters | None:
    """The verifiers' counters; None when they cannot be read (that point gets none)."""
    try:
        return await stack.spec_counters(client)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def _mode(client: httpx.AsyncClient, chainspec: bool) -> str:
    if not chainspec:
        return "run"
    return SPEC if await stack.drafters(client) else PLAIN


def run(cfg: SweepConfig, data: Dataset, compare_plain: bool = False,
        control: StackControl = StackControl()) -> dict[str, Any]:
    return asyncio.run(run_sweep(cfg, data, compare_plain, control))

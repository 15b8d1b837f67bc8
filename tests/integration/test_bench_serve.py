"""`chainspec bench serve` against a fake OpenAI streaming server with known, injected
latencies: the reported TTFT/ITL/TPOT/e2e percentiles and throughputs match what was
injected, errors are counted by kind, speculation figures come from /metrics deltas,
--compare-plain runs with drafters at 0 and restores them, and the CLI writes its files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from chainspec.benchserve import stack, sweep
from chainspec.benchserve.config import SLO, LoadKind, LoadPoint, SweepConfig
from chainspec.benchserve.dataset import BenchRequest, Dataset
from chainspec.cli import main

pytestmark = pytest.mark.timeout(120)
TTFT_S, ITL_S, CHUNKS, TOKENS_PER_CHUNK = 0.06, 0.015, 10, 2
TOKENS = CHUNKS * TOKENS_PER_CHUNK
E2E_S = TTFT_S + (CHUNKS - 1) * ITL_S  # 195 ms
SLACK_S = 0.05  # scheduling on a busy 2-core machine: latencies only ever grow


class Fake:
    """A streaming /v1/completions with TTFT_S before the first chunk and ITL_S between
    chunks of TOKENS_PER_CHUNK tokens; prompt "FAIL" gets a 500, "CUT" an error event.
    Looks like a chainspec gateway: /health drafters, one verifier's counters with one
    drafted round (3 drafts, 1 accepted at position 0) per chunk."""

    def __init__(self) -> None:
        self.drafters, self.rounds = 1, 0
        app = FastAPI()
        app.post("/v1/completions")(self.complete)
        app.get("/v1/models")(lambda: {"data": [{"id": "fake"}]})
        app.get("/health")(lambda: {"drafters": self.drafters, "speculative": True})
        app.get("/v1/metrics/targets")(lambda: [{"targets": [f"127.0.0.1:{self.port}"],
                                                 "labels": {"role": "verifier",
                                                            "__metrics_path__": "/vm"}}])
        app.get("/vm")(self.metrics)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.server.capture_signals = contextlib.nullcontext
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    async def complete(self, request: Request):
        body = await request.json()
        if body["prompt"] == "FAIL":
            return JSONResponse({"error": {"message": "injected"}}, 500)
        return StreamingResponse(self.events(body["prompt"] == "CUT"),
                                 media_type="text/event-stream")

    async def events(self, cut: bool):
        def event(data) -> str:
            return f"data: {json.dumps(data)}\n\n"
        await asyncio.sleep(TTFT_S)
        for i in range(CHUNKS):
            if i:
                await asyncio.sleep(ITL_S)
            if cut and i == 3:
                yield event({"error": {"message": "injected"}})
                return
            self.rounds += self.drafters > 0
            yield event({"choices": [{"index": 0, "text": "ab", "finish_reason": None}]})
        yield event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": TOKENS}})
        yield "data: [DONE]\n\n"

    def metrics(self) -> PlainTextResponse:
        p = "chainspec_spec_decode_num_"
        lines = [f'{p}drafts_total{{model="f"}} {self.rounds}',
                 f'{p}draft_tokens_total{{model="f"}} {3 * self.rounds}',
                 f'{p}accepted_tokens_total{{model="f"}} {self.rounds}'] + \
                [f'{p}accepted_tokens_per_pos_total{{model="f",position="{i}"}} '
                 f'{self.rounds if i == 0 else 0}' for i in range(3)]
        return PlainTextResponse("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def fake():
    f = Fake()
    f.thread.start()
    deadline = time.monotonic() + 20
    while not f.server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f
    f.server.should_exit = True
    f.thread.join(10)


def config(fake: Fake, *points: LoadPoint, n: int = 12, **kw) -> SweepConfig:
    return SweepConfig(fake.url, points, n, **kw)


def prompts(*texts: str) -> Dataset:
    return Dataset("test", tuple(BenchRequest(t, TOKENS) for t in texts))


def within(value_ms: float, injected_s: float, slack_s: float = SLACK_S) -> bool:
    return injected_s * 1e3 * 0.9 <= value_ms <= (injected_s + slack_s) * 1e3


def test_fixed_concurrency_reports_the_injected_latencies(fake) -> None:
    out = sweep.run(config(fake, LoadPoint(LoadKind.CONCURRENCY, 4)), prompts("a", "b"))
    (point,) = out["runs"]["spec"]
    assert (point["completed"], point["errors"]) == (12, 0)
    for pct in ("p50", "p90"):
        assert within(point["ttft_ms"][pct], TTFT_S), point["ttft_ms"]
        assert within(point["e2e_ms"][pct], E2E_S), point["e2e_ms"]
        assert within(point["tpot_ms"][pct], (E2E_S - TTFT_S) / (TOKENS - 1), 0.003)
    assert within(point["itl_ms"]["p50"], ITL_S, 0.02), point["itl_ms"]
    e2e_mean = point["e2e_ms"]["mean"] / 1e3
    assert point["request_throughput"] == pytest.approx(4 / e2e_mean, rel=0.2)
    assert point["output_throughput"] == pytest.approx(TOKENS * point["request_throughput"])
    # speculation figures: deltas of the fake verifier's counters over the point only
    assert point["speculative"]["drafted_rounds"] == 12 * CHUNKS
    assert point["speculative"]["acceptance_length"] == pytest.approx(2.0)
    assert point["speculative"]["per_position"] == pytest.approx([1.0, 0.0, 0.0])


def test_poisson_rate_and_goodput(fake) -> None:
    cfg = config(fake, LoadPoint(LoadKind.RATE, 20.0), n=16, seed=3,
                 slo=SLO(ttft_ms=TTFT_S * 1e3 - 1))  # nobody meets a TTFT below the injected
    (point,) = sweep.run(cfg, prompts("a"))["runs"]["spec"]
    assert point["completed"] == 16 and within(point["ttft_ms"]["p50"], TTFT_S)
    assert point["request_throughput"] < 20 * 1.6  # bounded by the arrivals, not the server
    assert point["goodput"] == 0.0
    cfg = config(fake, LoadPoint(LoadKind.RATE, 20.0), n=4, slo=SLO(e2e_ms=10_000))
    (point,) = sweep.run(cfg, prompts("a"))["runs"]["spec"]
    assert point["goodput"] == pytest.approx(point["request_throughput"])


def test_errors_are_counted_by_kind_and_left_out_of_latencies(fake) -> None:
    data = prompts("a", "FAIL", "CUT", "a")
    (point,) = sweep.run(config(fake, LoadPoint(LoadKind.CONCURRENCY, 2), n=8, warmup_requests=0),
                         data)["runs"]["spec"]
    assert (point["completed"], point["errors"]) == (4, 4)
    assert point["error_kinds"] == {"http 500": 2, "stream error": 2}
    assert within(point["e2e_ms"]["p90"], E2E_S)  # cut streams are not in the latencies


@pytest.mark.parametrize("policy", [None, "auto:1-3"])
def test_compare_plain_scales_drafters_to_zero_and_back(fake, monkeypatch, policy) -> None:
    """Back to the count it had, or to its autoscaling policy (not a fixed count)."""
    scaled = []

    async def scale(client, n: int | str, args: list[str]) -> None:
        scaled.append((n, args))
        fake.drafters = n if isinstance(n, int) else 1

    async def autoscale_spec(args: list[str]) -> str | None:
        assert args == ["--namespace", "x"]
        return policy

    monkeypatch.setattr(stack, "scale_drafters", scale)
    monkeypatch.setattr(stack, "autoscale_spec", autoscale_spec)
    out = sweep.run(config(fake, LoadPoint(LoadKind.CONCURRENCY, 2), n=4), prompts("a"),
                    True, sweep.StackControl(("--namespace", "x")))
    assert scaled == [(0, ["--namespace", "x"]), (policy or 1, ["--namespace", "x"])]
    assert out["runs"]["plain"][0]["speculative"]["acceptance_length"] is None
    assert out["runs"]["spec"][0]["speculative"]["acceptance_length"] == pytest.approx(2.0)
    assert {n for _, n in out["drafters_over_time"]} <= {0, 1}


def test_cli_writes_json_markdown_and_plots(fake, tmp_path, capsys) -> None:
    rc = main(["bench", "serve", "--base-url", fake.url, "--concurrency", "1,2",
               "--request-rate", "30", "--num-prompts", "4", "--out", str(tmp_path),
               "--goodput", "e2e:5000"])
    assert rc == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [p["load"]["label"] for p in report["runs"]["spec"]] == ["c=1", "c=2", "30 req/s"]
    md = (tmp_path / "serve.md").read_text()
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["acceptance_per_position.png", "drafters_over_time.png",
                    "latency_percentiles.png", "throughput_latency.png"]
    assert all((tmp_path / p).stat().st_size < 200_000 for p in pngs)
    assert "| c=2 |" in md and all(f"]({p})" in md for p in pngs)


def test_idle_tail_keeps_recording_drafters_after_the_last_point(fake) -> None:
    """--idle-tail: the timeline runs on past the load (where autoscaling drains)."""
    out = sweep.run(config(fake, LoadPoint(LoadKind.CONCURRENCY, 1), n=2, idle_tail_s=1.5),
                    prompts("a"), False)
    end = out["runs"]["spec"][0]["t_end_s"]
    assert max(t for t, _ in out["drafters_over_time"]) >= end + 1.0


def test_points_whose_every_request_fails_are_written_and_marked_failed(fake, tmp_path,
                                                                        capsys) -> None:
    """Nothing completes: no latency figure exists, yet the JSON, the markdown and the
    plots are written, each point marked failed, and the exit code says so."""
    data = tmp_path / "fail.jsonl"
    data.write_text('{"prompt": "FAIL"}\n')
    rc = main(["bench", "serve", "--base-url", fake.url, "--concurrency", "1,2",
               "--request-rate", "30", "--num-prompts", "3", "--dataset", "jsonl",
               "--dataset-path", str(data), "--out", str(tmp_path)])
    assert rc == 1
    report = json.loads((tmp_path / "serve.json").read_text())
    points = report["runs"]["spec"]
    assert [(p["failed"], p["completed"], p["errors"]) for p in points] == [(True, 0, 3)] * 3
    assert points[0]["ttft_ms"]["p50"] is None and report["error"] is None
    assert (tmp_path / "serve.md").read_text().count("3 (all: failed)") == 3
    assert (tmp_path / "throughput_latency.png").stat().st_size > 0
    assert "plots not written" not in capsys.readouterr().err


def test_a_sweep_that_stops_keeps_its_finished_points(fake, monkeypatch, tmp_path,
                                                      capsys) -> None:
    """The stack lost before the plain run: the spec points stay, with the reason."""
    async def scale(client, n, args) -> None:
        raise RuntimeError("`chainspec scale drafters 0` failed (1): stack gone")

    async def autoscale_spec(args: list[str]) -> str | None:
        return None

    monkeypatch.setattr(stack, "scale_drafters", scale)
    monkeypatch.setattr(stack, "autoscale_spec", autoscale_spec)
    rc = main(["bench", "serve", "--base-url", fake.url, "--concurrency", "1",
               "--num-prompts", "2", "--compare-plain", "--no-plots", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "serve.json").read_text())
    assert rc == 1 and report["runs"]["spec"][0]["completed"] == 2
    assert "stack gone" in report["error"] and "plain" not in report["runs"]
    err = capsys.readouterr().err.strip().splitlines()
    assert "stopped early" in err[-1] and "stack gone" in err[-1]
    assert "Traceback" not in "".join(err)
    assert "The sweep stopped early" in (tmp_path / "serve.md").read_text()

"""Tools made for vLLM read `chainspec serve` unchanged.

NVIDIA's aiperf (a real third-party load generator, in its own venv: `make tools`) runs
a short streaming benchmark against the gateway: every request completes without
error, it parses the server's token usage, and from the gateway's /metrics (which it
scrapes by default, as it does a vLLM server's) it reads the `vllm:` counters, whose
deltas over its run match what it sent. Without the tool the test skips, or fails under
CHAINSPEC_REQUIRE_TOOLS=1. The gateway's `vllm:` sums are also checked against the
verifier's own `chainspec_` counters, tool or not."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chainspec.cluster import stack
from chainspec.engine.local import DEMO_MODEL
from tests import tools
from tests.integration.helpers import start_serve, stop_serve

pytestmark = pytest.mark.timeout(300)
NS = "chainspec-tooling-test"
REQUESTS, CONCURRENCY, ISL, OSL = 6, 2, 16, 12


@pytest.fixture(scope="module")
def served(ray_cluster):
    s = start_serve(DEMO_MODEL, NS, "--max-seqs", "4")
    yield s
    stop_serve(s, NS, 60)


def scrape(url: str) -> dict[tuple, float]:
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(samples: dict[tuple, float], name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def complete(url: str, max_tokens: int) -> dict:
    body = {"model": "demo", "prompt": "def fibonacci(n):", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_the_gateways_vllm_names_sum_the_verifiers_counters(served):
    for n in (5, 9):
        complete(served.url, n)
    [verifier] = [m for m in stack.status(namespace=NS) if m["role"] == "verifier"]
    own, view = scrape(verifier["metrics_url"]), scrape(f"{served.url}/metrics")
    pairs = {"vllm:spec_decode_num_drafts_total": "chainspec_spec_decode_num_drafts_total",
             "vllm:spec_decode_num_accepted_tokens_total":
                 "chainspec_spec_decode_num_accepted_tokens_total",
             "vllm:generation_tokens_total": "chainspec_generation_tokens_total",
             "vllm:prompt_tokens_total": "chainspec_prompt_tokens_total",
             "vllm:e2e_request_latency_seconds_count":
                 "chainspec_e2e_request_latency_seconds_count",
             "vllm:prefix_cache_queries_total": "chainspec_prefix_cache_queries_total"}
    for vllm, mine in pairs.items():
        assert total(view, vllm, model_name="demo") == total(own, mine) > 0, vllm
    assert total(view, "vllm:generation_tokens_total") >= 14
    assert total(view, "vllm:request_success_total", finished_reason="length") == \
        total(own, "chainspec_request_success_total", finished_reason="length") >= 2
    per_pos = [total(view, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(i)) for i in range(3)]
    assert sum(per_pos) == total(view, "vllm:spec_decode_num_accepted_tokens_total")
    assert total(view, "vllm:num_requests_running") == 0


def test_aiperf_benchmarks_the_stack_and_reads_its_metrics(served, tmp_path):
    aiperf = tools.aiperf()
    out = tmp_path / "aiperf"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_HUB_OFFLINE")}
    argv = [aiperf, "profile", "--model", "demo", "--url", served.url,
            "--endpoint-type", "completions", "--streaming",
            "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
            "--synthetic-input-tokens-mean", str(ISL), "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(OSL), "--output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--tokenizer", str(DEMO_MODEL),
            "--artifact-dir", str(out), "--ui-type", "simple"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert report["is_complete"] and not report["was_cancelled"]
    assert report["completed_request_count"]["avg"] == REQUESTS
    assert report["request_error_rate"]["avg"] == 0 and not report.get("error_summary")
    # the server's usage, parsed from the stream
    assert report["total_usage_completion_tokens"]["avg"] == REQUESTS * OSL
    assert abs(report["usage_prompt_tokens"]["avg"] - ISL) <= 1  # its text, our tokenizer
    assert report["time_to_first_token"]["avg"] > 0
    assert report["inter_token_latency"]["avg"] > 0
    # what it read from the gateway's /metrics: deltas over its profiling run
    server = json.loads((out / "server_metrics_export.json").read_text())
    assert server["summary"]["endpoints_successful"] == [f"{served.url}/metrics"]
    metrics = server["metrics"]

    def run_total(name: str, **labels) -> float:
        return sum(s["stats"]["total"] for s in metrics[name]["series"]
                   if labels.items() <= s["labels"].items())
    assert run_total("vllm:request_success", finished_reason="length") == REQUESTS
    assert run_total("vllm:generation_tokens", model_name="demo") == REQUESTS * OSL
    drafts = run_total("vllm:spec_decode_num_drafts")
    accepted = run_total("vllm:spec_decode_num_accepted_tokens")
    assert drafts > 0 and 0 < accepted <= run_total("vllm:spec_decode_num_draft_tokens")
    assert metrics["vllm:time_to_first_token_seconds"]["type"] == "histogram"
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc"} <= set(metrics)

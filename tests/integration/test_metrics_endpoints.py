"""Every process's metrics endpoint after real requests (no Ray): a drafter and a verifier
over real gRPC with their own metrics ports, and a gateway in front. The counters move
consistently with what the clients received, each endpoint passes `promtool check
metrics`, and the gateway's discovery endpoint lists what it knows."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import LocalOptions
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.membership import StaticVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.metrics.drafter import DrafterMetrics
from chainspec.metrics.verifier import VerifierMetrics
from chainspec.models.loader import load_draft_model
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.server import ServerOptions
from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier
from tests.integration.helpers import verifier_stub
from tests.tools import promtool, promtool_check

pytestmark = pytest.mark.timeout(300)
K, MAX_LEN = 3, 256
PROMPTS = ["def fibonacci(n):", "hello world", "for i in range(3):", "The quick brown fox",
           "a", "print(i * i)"]
MAX_TOKENS = [16, 9, 24, 5, 12, 20]


@dataclass
class Services:
    gateway: GatewayServer
    verifier: object
    drafter: object


def scrape(url: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    """Exposition text and {(sample name, sorted labels): value}."""
    text = httpx.get(url, timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return text, samples


def total(samples, name: str, **labels) -> float:
    """Sum of `name` over the samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


@pytest.fixture(scope="module")
def services(model_dir, loop_thread):
    metrics = DrafterMetrics("tiny", K)
    engine = DrafterEngine(load_draft_model(model_dir, cache_len=MAX_LEN),
                           DrafterConfig(num_steps=K, max_seqs=16, max_len=MAX_LEN),
                           observer=metrics)
    drafter = loop_thread.run(serve_drafter(engine, ServerOptions(metrics_port=0), "tiny",
                                            metrics=metrics))
    opts = VerifierOptions(LocalOptions(model_dir=model_dir, num_steps=K, max_seqs=8,
                                        max_len=MAX_LEN), model_name="tiny")
    verifier = loop_thread.run(serve_verifier(opts, ServerOptions(metrics_port=0),
                                              [drafter.address],
                                              metrics=VerifierMetrics("tiny", K)))
    gateway = loop_thread.run(GatewayServer.start(GatewayConfig(port=0, refresh_interval_s=0.2),
                                                  StaticVerifiers([verifier.address])))
    assert loop_thread.run(gateway.wait_ready(30, drafters=1))
    yield Services(gateway, verifier, drafter)
    loop_thread.run(gateway.stop())
    loop_thread.run(verifier.stop())
    loop_thread.run(drafter.stop())


@pytest.fixture(scope="module")
def usage(services):
    """Completions through the gateway (one streamed); their usage blocks."""
    url = f"{services.gateway.url}/v1/completions"
    got = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        if i == 0:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
            got.append(httpx.Response(200, content=events[-1]).json()["usage"])
        else:
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 200, r.text
            got.append(r.json()["usage"])
    return got


def test_verifier_counters_match_what_clients_got(services, usage):
    _, s = scrape(services.verifier.metrics_url())
    n = len(PROMPTS)
    spec = [u["speculative"] for u in usage]
    drafts = total(s, "chainspec_spec_decode_num_drafts_total")
    draft_tokens = total(s, "chainspec_spec_decode_num_draft_tokens_total")
    accepted = total(s, "chainspec_spec_decode_num_accepted_tokens_total")
    per_pos = [total(s, "chainspec_spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(i)) for i in range(K)]
    assert drafts == sum(x["rounds"] - x["fallback_rounds"] for x in spec) > 0
    assert 0 < accepted == sum(x["accepted_tokens"] for x in spec) <= draft_tokens
    assert draft_tokens == sum(x["draft_tokens"] for x in spec)
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    assert total(s, "chainspec_plain_decode_fallbacks_total") == \
        sum(x["fallback_rounds"] for x in spec)
    assert total(s, "chainspec_generation_tokens_total") == \
        sum(u["completion_tokens"] for u in usage) == sum(MAX_TOKENS)
    assert total(s, "chainspec_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    for name in ("chainspec_time_to_first_token_seconds_count",
                 "chainspec_e2e_request_latency_seconds_count",
                 "chainspec_request_queue_time_seconds_count"):
        assert total(s, name) == n, name
    assert total(s, "chainspec_inter_token_latency_seconds_count") == sum(MAX_TOKENS) - n
    assert total(s, "chainspec_request_success_total", finished_reason="length") == n
    assert total(s, "chainspec_num_requests_running") == 0
    assert total(s, "chainspec_draft_round_trip_seconds_count") > 0
    assert total(s, "chainspec_draft_transfer_bytes_total", direction="sent") > \
        total(s, "chainspec_draft_transfer_bytes_total", direction="received") > 0
    assert total(s, "chainspec_drafters_connected") == 1
    assert total(s, "chainspec_grpc_server_handled_total",
                 method="/chainspec.v1.Verifier/Generate", code="OK") == n
    info = [ls for (name, ls) in s if name == "chainspec_build_info"]
    assert dict(info[0]) | {"version": ""} == {"model_name": "tiny", "num_steps": "3",
                                               "dtype": "float32", "chain": "true",
                                               "version": ""}


def test_drafter_counters(services, usage):
    _, s = scrape(services.drafter.metrics_url())
    rounds = total(s, "chainspec_drafter_round_seconds_count")
    assert rounds > 0
    assert total(s, "chainspec_drafter_eager_runs_total") + \
        total(s, "chainspec_drafter_graph_replays_total") == rounds
    for step in range(1, K + 1):  # CPU: every round eager, every step timed
        assert total(s, "chainspec_drafter_step_seconds_count", step=str(step)) == rounds
    assert total(s, "chainspec_drafter_batch_size_count") == rounds
    assert total(s, "chainspec_drafter_out_of_sync_total") == 0
    assert total(s, "chainspec_grpc_server_started_total",
                 method="/chainspec.v1.Drafter/Draft") >= 1
    assert total(s, "chainspec_grpc_server_msg_received_total",
                 method="/chainspec.v1.Drafter/Draft") >= rounds - 1  # warm-up: no message
    # releases reach the drafter right after the last tokens
    deadline = time.monotonic() + 10
    while total(s, "chainspec_drafter_sequences") and time.monotonic() < deadline:
        time.sleep(0.1)
        _, s = scrape(services.drafter.metrics_url())
    assert total(s, "chainspec_drafter_sequences") == 0


def test_gateway_counters(services, usage):
    _, s = scrape(f"{services.gateway.url}/metrics")
    n = len(PROMPTS)
    assert total(s, "chainspec_gateway_requests_total", route="/v1/completions",
                 code="200") == n
    assert total(s, "chainspec_gateway_time_to_first_token_seconds_count") == n
    assert total(s, "chainspec_gateway_request_duration_seconds_count") == n
    assert total(s, "chainspec_gateway_verifiers") == 1
    assert total(s, "chainspec_gateway_drafters") == 1
    assert total(s, "chainspec_gateway_in_flight_requests") == 0


def test_refused_calls_are_counted_by_code(services, usage):
    channel, stub = verifier_stub(services.verifier.address)
    req = pb.GenerateRequest(stop=pb.StopConditions(max_tokens=2))
    req.tokens.ids.extend([10 ** 6])  # out of the vocabulary: INVALID_ARGUMENT
    with pytest.raises(Exception, match="INVALID_ARGUMENT"):
        list(stub.Generate(req, timeout=10))
    channel.close()
    _, s = scrape(services.verifier.metrics_url())
    assert total(s, "chainspec_grpc_server_handled_total", code="INVALID_ARGUMENT",
                 method="/chainspec.v1.Verifier/Generate") == 1


@pytest.mark.parametrize("which", ["drafter", "verifier", "gateway"])
def test_promtool_accepts_every_endpoint(services, usage, which):
    url = {"drafter": services.drafter.metrics_url(),
           "verifier": services.verifier.metrics_url(),
           "gateway": f"{services.gateway.url}/metrics"}[which]
    text, _ = scrape(url)
    if which != "gateway":
        promtool_check("metrics", stdin=text)
        return
    # NOTE: promtool lints colons in the gateway's vllm: names, as it does in vLLM's own
    # /metrics (the names tools look for); any other problem, a parse error too, fails
    proc = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()
                and not re.fullmatch(r"vllm:\w+ metric names should not contain ':'", line)]
    assert "vllm:spec_decode_num_drafts_total" in text and problems == [], problems


def test_discovery_without_a_controller_lists_the_gateway_itself(services):
    groups = httpx.get(f"{services.gateway.url}/v1/metrics/targets", timeout=10).json()
    port = services.gateway.port
    assert groups == [{"targets": [f"127.0.0.1:{port}"],
                       "labels": {"role": "gateway", "member": "gateway",
                                  "__metrics_path__": "/metrics"}}]

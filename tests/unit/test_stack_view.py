"""The gateway's vLLM-named view of the stack: sums of real verifier expositions, kept
monotonic as verifiers leave, restart or miss a scrape."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from chainspec.engine.request import FinishReason
from chainspec.gateway.metrics import GatewayMetrics
from chainspec.metrics.stack_view import COUNTERS, GAUGES, HISTOGRAMS, StackView
from chainspec.metrics.verifier import VerifierMetrics

K = 3


def verifier(drafts: int, accepted: tuple[int, ...], running: int, kv: float,
             ttft: tuple[float, ...] = ()) -> str:
    """A real verifier registry's exposition with these values."""
    vm = VerifierMetrics("v-model", K)
    vm.drafts.value = drafts
    vm.draft_tokens.value = K * drafts
    vm.accepted.value = sum(accepted)
    for child, n in zip(vm.accepted_per_pos, accepted, strict=True):
        child.value = n
    vm.finished[FinishReason.EOS].value = drafts  # EOS is vLLM's "stop"
    vm.running.value, vm.kv_usage.value = running, kv
    for t in ttft:
        vm.ttft.observe(t)
    return generate_latest(vm.registry).decode()


def samples(view: StackView, model_name: str = "") -> dict[tuple, float]:
    out = {}
    for family in view.families(model_name):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(got: dict, name: str, **labels) -> float:
    matches = [v for (n, ls), v in got.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def test_two_verifiers_sum_under_vllm_names_with_model_name():
    view = StackView()
    view.update({"v0": verifier(10, (8, 5, 2), running=3, kv=0.5, ttft=(0.001, 0.3)),
                 "v1": verifier(4, (3, 1, 0), running=1, kv=0.1, ttft=(0.3,))})
    got = samples(view)
    assert value(got, "vllm:spec_decode_num_drafts_total", model_name="v-model") == 14
    assert value(got, "vllm:spec_decode_num_draft_tokens_total") == 3 * 14
    assert value(got, "vllm:spec_decode_num_accepted_tokens_total") == 19
    per_pos = [value(got, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(i)) for i in range(K)]
    assert per_pos == [11, 6, 2]
    assert value(got, "vllm:request_success_total", finished_reason="stop") == 14
    assert value(got, "vllm:request_success_total", finished_reason="length") == 0
    assert value(got, "vllm:num_requests_running") == 4  # summed
    assert value(got, "vllm:kv_cache_usage_perc") == pytest.approx(0.3)  # the mean
    assert value(got, "vllm:time_to_first_token_seconds_count") == 3
    assert value(got, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.601)
    assert value(got, "vllm:time_to_first_token_seconds_bucket", le="0.001") == 1
    assert value(got, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 3
    # the gateway's served name replaces the verifiers' own
    assert value(samples(view, "served"), "vllm:num_requests_running",
                 model_name="served") == 4


def test_counters_stay_monotonic_as_verifiers_leave_restart_and_miss_scrapes():
    view = StackView()

    def drafts() -> float:
        return value(samples(view), "vllm:spec_decode_num_drafts_total")
    view.update({"v0": verifier(10, (1, 0, 0), 2, 0.2), "v1": verifier(5, (1, 0, 0), 1, 0.4)})
    assert drafts() == 15
    view.update({"v0": None, "v1": verifier(6, (1, 0, 0), 1, 0.4)})  # v0 did not answer
    assert drafts() == 16
    view.update({"v0": "<html>502</html>{", "v1": verifier(6, (1, 0, 0), 1, 0.4)})
    assert drafts() == 16  # an answer that is no exposition: a missed scrape too
    view.update({"v1": verifier(7, (1, 0, 0), 1, 0.4)})  # v0 left: its 10 still count
    assert drafts() == 17
    assert value(samples(view), "vllm:num_requests_running") == 1  # gauges: live ones only
    view.update({"v0": verifier(10, (1, 0, 0), 2, 0.2), "v1": verifier(7, (1, 0, 0), 1, 0.4)})
    assert drafts() == 17  # v0 back unchanged (a membership blip): not counted twice
    view.update({"v0": verifier(2, (1, 0, 0), 0, 0.0), "v1": verifier(7, (1, 0, 0), 1, 0.4)})
    assert drafts() == 19  # v0 restarted: 10 before plus 2 since


def test_an_empty_stack_still_exports_every_name():
    got = samples(StackView())
    names = {n for n, _ in got}
    for targets in COUNTERS.values():
        assert {t + "_total" for t in targets} <= names
    assert {t for t, _ in GAUGES.values()} <= names
    assert value(got, "vllm:num_requests_waiting") == 0


def test_the_gateway_serves_them_after_scraping_its_verifier_members(monkeypatch):
    texts = {"http://v0/metrics": verifier(3, (2, 1, 0), 1, 0.25),
             "http://v1/metrics": None}  # down: skipped
    monkeypatch.setattr("chainspec.gateway.metrics._scrape", lambda url, t: texts[url])
    gm = GatewayMetrics("served-name")
    members = [{"member_id": "verifier-0", "role": "verifier", "state": "ready",
                "metrics_url": "http://v0/metrics"},
               {"member_id": "verifier-1", "role": "verifier", "state": "ready",
                "metrics_url": "http://v1/metrics"},
               {"member_id": "drafter-0", "role": "drafter", "state": "ready",
                "metrics_url": "http://d0/metrics"}]  # not a verifier: not read
    asyncio.run(gm.stack.refresh(members))
    text = gm.exposition()[0].decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="served-name"} 3.0' in text
    parsed = {f.name for f in text_string_to_metric_families(text)}
    expected = {t for ts in (*COUNTERS.values(), *HISTOGRAMS.values()) for t in ts}
    assert expected | {t for t, _ in GAUGES.values()} <= parsed

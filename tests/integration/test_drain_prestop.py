"""The chart's preStop hook drains a drafter before its pod stops (issue 22 item 7): the
same entry point (`chainspec drain`, from another process) against a stack on the
session's Ray, while 16 streams run. Every stream completes and equals plain decoding,
no request is ever without a drafter (the verifier's `no_drafter` fallbacks stay 0; rounds
decoded plainly for `late`/`stale`/`resync` do happen while sequences move and the
replacement loads on the shared cores), the command returns once the member is gone, and
the replacement comes up (the desired count stays)."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chainspec.cluster import stack
from chainspec.cluster.config import DrafterRoleConfig, StackConfig
from tests.integration import helpers
from tests.integration.helpers import LoadGenerator, plain_outputs, prompt_ids, verifier_stub

pytestmark = pytest.mark.timeout(300)
NS = "chainspec-drain-test"
TOKENS = 48


def members(role: str) -> list[dict]:
    return [m for m in stack.status(namespace=NS) if m["role"] == role]


def fallbacks(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "chainspec_plain_decode_fallbacks_total"}


@pytest.fixture(scope="module")
def up(ray_cluster, model_dir):
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=16, max_len=256,
                         health_interval_s=0.5, health_timeout_s=3.0, drain_timeout_s=20.0,
                         drafter=DrafterRoleConfig(replicas=2), namespace=NS)
    stack.up(config)
    yield config
    stack.down(namespace=NS)


def test_drain_of_a_drafter_under_load_leaves_no_request_without_drafts(up, model_dir):
    prompts = prompt_ids(model_dir, 8)
    expected = plain_outputs(model_dir, prompts, TOKENS)
    verifier = members("verifier")[0]
    channel, stub = verifier_stub(verifier["endpoint"])
    load = LoadGenerator(stub, prompts, expected, max_tokens=TOKENS, workers=16)
    try:
        holding = helpers.wait_for(
            lambda: [m for m in members("drafter") if m["load"] > 0] if all(
                m["load"] > 0 for m in members("drafter")) else None,
            60, "both drafters holding sequences")
        victim = holding[0]["member_id"]
        before, done_before = fallbacks(verifier["metrics_url"]), load.done
        r = helpers.cli(NS, "drain", victim)  # what the preStop hook runs (with --self)
        assert r.returncode == 0, r.stderr
        assert f"drained {victim}" in r.stdout
        # it returns once the member is gone: the pod may stop then
        assert victim not in {m["member_id"] for m in members("drafter")}
        helpers.wait_for(lambda: load.done > done_before + 16, 60, "requests after the drain")
    finally:
        load.stop()
        channel.close()
    after = fallbacks(verifier["metrics_url"])
    assert load.failures == []
    assert after.get("no_drafter", 0) == before.get("no_drafter", 0) == 0, (before, after)
    helpers.wait_for(lambda: len([m for m in members("drafter") if m["state"] == "ready"])
                     == 2, 60, "the replacement drafter ready (the desired count kept)")

"""The engines' observers: the metrics move consistently with what the requests got, the
fallback reasons name why drafts were missing, and observing adds no host-device sync."""

from __future__ import annotations

import pytest
import torch

from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.draft_types import DraftResult, ErrorCode, SeqFailure, SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import LocalOptions, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.step_clock import StepClock
from chainspec.engine.verifier import VerifierConfig, VerifierEngine
from chainspec.metrics.drafter import DrafterMetrics
from chainspec.metrics.verifier import VerifierMetrics
from tests.integration.tiny_checkpoint import write_tiny_model

K = 3
STOP = StopConditions(max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2], [7] * 11, [3, 4], list(range(1, 30))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    return load_models(LocalOptions(model_dir, num_steps=K, max_seqs=8, max_len=256))


def build(models, verifier_metrics=None, drafter_metrics=None, client=None):
    if client is None:
        client = LocalDraftClient(DrafterEngine(models.draft, DrafterConfig(
            num_steps=K, max_seqs=8, max_len=256), observer=drafter_metrics))
    config = VerifierConfig(num_steps=K, max_seqs=8, max_len=256, max_batch_tokens=64,
                            prefill_chunk=8)
    return VerifierEngine(models.target, config, client, observer=verifier_metrics)


def value(metrics, name: str, **labels) -> float:
    got = metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels})
    return 0.0 if got is None else got


def test_verifier_counters_agree_with_the_requests(models):
    vm, dm = VerifierMetrics("tiny", K), DrafterMetrics("tiny", K)
    result = run_to_completion(build(models, vm, dm), PROMPTS,
                               SamplingParams(temperature=0.0), STOP)
    stats = [c.stats for c in result.completions]
    n = len(PROMPTS)
    drafts = value(vm, "chainspec_spec_decode_num_drafts_total")
    draft_tokens = value(vm, "chainspec_spec_decode_num_draft_tokens_total")
    accepted = value(vm, "chainspec_spec_decode_num_accepted_tokens_total")
    per_pos = [value(vm, "chainspec_spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(i)) for i in range(K)]
    assert drafts == sum(s.rounds for s in stats) > 0
    assert draft_tokens == sum(s.draft_tokens for s in stats) == K * drafts
    assert 0 < accepted == sum(s.accepted_tokens for s in stats) <= draft_tokens
    assert per_pos == [sum(s.accepted_per_pos[i] for s in stats) for i in range(K)]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    generated = result.generated_tokens
    assert value(vm, "chainspec_generation_tokens_total") == generated == n * STOP.max_tokens
    assert value(vm, "chainspec_prompt_tokens_total") == sum(map(len, PROMPTS))
    assert value(vm, "chainspec_time_to_first_token_seconds_count") == n
    assert value(vm, "chainspec_request_queue_time_seconds_count") == n
    assert value(vm, "chainspec_e2e_request_latency_seconds_count") == n
    assert value(vm, "chainspec_inter_token_latency_seconds_count") == generated - n
    assert value(vm, "chainspec_request_success_total", finished_reason="length") == n
    # per-request histograms: one sample per request, sums equal the token counts
    assert value(vm, "chainspec_request_prompt_tokens_count") == n
    assert value(vm, "chainspec_request_prompt_tokens_sum") == sum(map(len, PROMPTS))
    assert value(vm, "chainspec_request_generation_tokens_sum") == generated
    for phase in ("prefill", "decode", "inference"):
        assert value(vm, f"chainspec_request_{phase}_time_seconds_count") == n, phase
    assert value(vm, "chainspec_request_time_per_output_token_seconds_count") == n
    # the phases add up: queue + prefill + decode = end to end (same clock readings)
    e2e = value(vm, "chainspec_e2e_request_latency_seconds_sum")
    parts = sum(value(vm, f"chainspec_{name}_seconds_sum") for name in (
        "request_queue_time", "request_prefill_time", "request_decode_time"))
    assert parts == pytest.approx(e2e, rel=1e-6)
    assert value(vm, "chainspec_request_inference_time_seconds_sum") == pytest.approx(
        e2e - value(vm, "chainspec_request_queue_time_seconds_sum"), rel=1e-6)
    assert value(vm, "chainspec_verify_step_seconds_count") > 0
    assert value(vm, "chainspec_plain_decode_fallbacks_total", reason="late") == 0
    assert value(vm, "chainspec_num_requests_running") == 0
    assert value(vm, "chainspec_kv_cache_usage_perc") == 0
    # the drafter: every round eager on CPU, each with K timed steps, nothing held after
    rounds = value(dm, "chainspec_drafter_batch_size_count")
    eager = sum(value(dm, "chainspec_drafter_eager_runs_total", reason=r)
                for r in ("no_graph", "window_too_large", "batch_too_large"))
    assert rounds == eager == value(dm, "chainspec_drafter_round_seconds_count") > 0
    assert value(dm, "chainspec_drafter_graph_replays_total") == 0
    for step in range(1, K + 1):
        assert value(dm, "chainspec_drafter_step_seconds_count", step=str(step)) == rounds
    assert value(dm, "chainspec_drafter_round_depth_total", depth=str(K)) == rounds
    assert value(dm, "chainspec_drafter_window_rows_sum") >= value(
        dm, "chainspec_drafter_window_rows_count") == value(dm, "chainspec_drafter_batch_size_sum")
    assert value(dm, "chainspec_drafter_sequences") == 0


def test_drafter_counts_rounds_by_the_draft_steps_they_ran(models):
    """Drafter-side depth (4.11): a round of D steps counts under depth D, and times D
    steps; the prompt's round runs all K."""
    dm = DrafterMetrics("tiny", K)
    eng = DrafterEngine(models.draft, DrafterConfig(num_steps=K, max_seqs=2, max_len=256),
                        observer=dm)
    h = models.draft.config.hidden_size
    eng.update([SeqUpdate(0, 0, (1, 2, 3), torch.randn(3, h))])
    for i, ask in enumerate((1, 2, 1)):
        eng.update([SeqUpdate(0, 3 + 2 * i, (4, 5), torch.randn(2, h), num_drafts=ask)])
    assert [value(dm, "chainspec_drafter_round_depth_total", depth=str(d))
            for d in range(1, K + 1)] == [2, 1, 1]
    assert [value(dm, "chainspec_drafter_step_seconds_count", step=str(k))
            for k in range(1, K + 1)] == [4, 2, 1]


class _NoDrafts:
    """A draft client that answers nothing (every round misses its drafts) or refuses
    every update with `code`."""

    def __init__(self, code: ErrorCode | None = None) -> None:
        self.code, self.ready = code, {}

    def submit(self, updates):
        if self.code is not None:
            self.ready.update({u.seq_id: SeqFailure(u.seq_id, self.code, "no") for u in updates})

    def collect(self, wait_for=None):
        ready, self.ready = self.ready, {}
        return ready

    def release(self, seq_ids):
        pass


@pytest.mark.parametrize("code,reason", [(None, "late"), (ErrorCode.UNAVAILABLE, "no_drafter"),
                                         (ErrorCode.FAILED_PRECONDITION, "resync")])
def test_fallbacks_name_why_the_drafts_were_missing(models, code, reason):
    vm = VerifierMetrics("tiny", K)
    result = run_to_completion(build(models, vm, client=_NoDrafts(code)), PROMPTS[:2],
                               SamplingParams(temperature=0.0), STOP)
    decode_rounds = sum(c.stats.fallback_rounds for c in result.completions)
    assert decode_rounds == 2 * (STOP.max_tokens - 1)
    assert value(vm, "chainspec_plain_decode_fallbacks_total", reason=reason) == decode_rounds
    assert value(vm, "chainspec_spec_decode_num_drafts_total") == 0


def test_stale_drafts_are_a_fallback_reason(models):
    class Stale(_NoDrafts):
        def submit(self, updates):
            self.ready.update({u.seq_id: DraftResult(u.seq_id, 0, torch.zeros(K, dtype=torch.long))
                               for u in updates if u.want_drafts})
    vm = VerifierMetrics("tiny", K)
    run_to_completion(build(models, vm, client=Stale()), PROMPTS[:1],
                      SamplingParams(temperature=0.0), STOP)
    assert value(vm, "chainspec_plain_decode_fallbacks_total", reason="stale") == \
        STOP.max_tokens - 1


def test_observing_adds_no_host_sync(models, monkeypatch):
    """Same requests with and without metrics: the same number of .item/.tolist/.cpu
    calls (a metric read off a device tensor would add one per step)."""
    def syncs(verifier_metrics, drafter_metrics) -> int:
        engine = build(models, verifier_metrics, drafter_metrics)
        calls = {"n": 0}
        for name in ("item", "tolist", "cpu"):
            original = getattr(torch.Tensor, name)

            def counted(self, *a, _original=original, **kw):
                calls["n"] += 1
                return _original(self, *a, **kw)
            monkeypatch.setattr(torch.Tensor, name, counted)
        try:
            run_to_completion(engine, PROMPTS, SamplingParams(temperature=0.0), STOP)
        finally:
            monkeypatch.undo()
        return calls["n"]
    plain = syncs(None, None)
    observed = syncs(VerifierMetrics("tiny", K), DrafterMetrics("tiny", K))
    assert observed == plain > 0


def test_drafter_counts_out_of_sync_updates(models):
    dm = DrafterMetrics("tiny", K)
    engine = DrafterEngine(models.draft, DrafterConfig(num_steps=K, max_seqs=4, max_len=256),
                           observer=dm)
    hidden = torch.zeros(1, models.draft.config.hidden_size)
    out = engine.update([SeqUpdate(7, 5, (1,), hidden)])  # never started: out of sync
    assert out[0].code == ErrorCode.FAILED_PRECONDITION
    assert value(dm, "chainspec_drafter_out_of_sync_total") == 1
    assert value(dm, "chainspec_drafter_batch_size_count") == 0  # no round ran
    engine.update([SeqUpdate(7, 0, (1, 2), torch.zeros(2, hidden.shape[1]))])
    assert value(dm, "chainspec_drafter_sequences") == 1
    # one block of 16 positions held, of 4 sequences x 256 positions
    assert value(dm, "chainspec_drafter_kv_cache_usage_perc") == 1 / (4 * 256 // 16)
    engine.release([7])
    assert value(dm, "chainspec_drafter_sequences") == 0


def test_step_clock_on_cpu_gives_one_duration_per_step():
    clock = StepClock(torch.device("cpu"))
    assert clock.durations() == ()
    for _ in range(K + 1):
        clock.mark()
    got = clock.durations()
    assert len(got) == K and all(d >= 0 for d in got)


def test_depth_counter_counts_rounds_by_drafts_verified(models):
    """chainspec_spec_decode_depth{depth}: one count per verify round at its depth; rounds
    at depth 0 by choice (a request's cap 0) are fallbacks labelled depth."""
    vm = VerifierMetrics("tiny", K)
    eng = build(models, vm)
    greedy = SamplingParams(temperature=0.0)
    for i, (prompt, cap) in enumerate(zip(PROMPTS, [0, 1, 2, None], strict=True)):
        eng.add_request(f"r{i}", prompt, greedy, STOP, num_speculative_tokens=cap)
    stats = {}
    while eng.has_work:
        for out in eng.step():
            if out.stats is not None:
                stats[out.request_id] = out.stats
    depth = [value(vm, "chainspec_spec_decode_depth_total", depth=str(k)) for k in range(K + 1)]
    assert depth[1] == stats["r1"].rounds > 0 and depth[2] == stats["r2"].rounds > 0
    assert depth[3] == stats["r3"].rounds > 0
    plain_rounds = STOP.max_tokens - 1  # r0: every token after the prefill's first
    assert depth[0] == sum(s.fallback_rounds for s in stats.values()) >= plain_rounds
    assert value(vm, "chainspec_plain_decode_fallbacks_total", reason="depth") == \
        stats["r0"].fallback_rounds == plain_rounds
    assert sum(depth) == sum(s.rounds + s.fallback_rounds for s in stats.values())

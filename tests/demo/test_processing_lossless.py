"""Lossless under logits processing (issue 13): on the demo model, greedy speculative
output equals greedy plain output, token for token, with presence, frequency and
repetition penalties, logit_bias, min_tokens (with EOS) and stop_token_ids, over held-out
prompts at K = 1..4; each setting really changes the output. Logprobs of the committed
tokens equal plain decoding's within 1e-4."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from chainspec.engine.local import build_verifier
from chainspec.engine.request import FinishReason, StopConditions
from chainspec.engine.sampling import SamplingParams

PROMPTS, MAX_TOKENS, BATCH = 16, 24, 8


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    reasons: list[FinishReason | None]
    logprobs: list[list]
    drafted: int = 0
    accepted: int = 0


def generate(models, opts, prompts, params, stop, speculative: bool, eos=()) -> Run:
    eng = build_verifier(models, opts, speculative, eos_ids=eos)
    run = Run([[] for _ in prompts], [None] * len(prompts), [[] for _ in prompts])
    for start in range(0, len(prompts), BATCH):
        for i in range(start, min(start + BATCH, len(prompts))):
            eng.add_request(str(i), prompts[i], params, stop)
        while eng.has_work:
            for out in eng.step():
                i = int(out.request_id)
                run.tokens[i] += out.new_tokens
                run.logprobs[i] += out.logprobs or ()
                if out.finished:
                    run.reasons[i] = out.finish_reason
                    run.drafted += out.stats.draft_tokens
                    run.accepted += out.stats.accepted_tokens
    return run


@pytest.fixture(scope="module")
def prompts(heldout_prompts):
    return heldout_prompts[:PROMPTS]


@pytest.fixture(scope="module")
def common(prompts) -> list[int]:
    """The prompts' most frequent token ids (',', '(', 'def', newlines in the demo)."""
    counts = collections.Counter(t for p in prompts for t in p)
    return [t for t, _ in counts.most_common(6)]


def settings(common):
    """name -> (params, stop, eos ids); every one processes logits or stops on ids."""
    greedy = SamplingParams(temperature=0.0)
    free = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
    with_eos = StopConditions(max_tokens=MAX_TOKENS)
    return {
        "presence": (dataclasses.replace(greedy, presence_penalty=1.5), free, ()),
        "frequency": (dataclasses.replace(greedy, frequency_penalty=1.0), free, ()),
        "repetition": (dataclasses.replace(greedy, repetition_penalty=1.4), free, ()),
        "logit_bias": (dataclasses.replace(greedy, logit_bias={common[0]: 4.0,
                                                               common[3]: -6.0}), free, ()),
        "min_tokens": (dataclasses.replace(greedy, min_tokens=10), with_eos,
                       tuple(common[3:6])),
        "stop_token_ids": (greedy, StopConditions(max_tokens=MAX_TOKENS,
                                                  stop_token_ids=tuple(common[:3])), ()),
    }


@pytest.fixture(scope="module")
def plain_runs(demo_models, prompts, common):
    opts, models = demo_models
    base = generate(models, opts, prompts, SamplingParams(temperature=0.0),
                    StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True), False)
    runs = {name: generate(models, opts, prompts, *setting[:2], False, eos=setting[2])
            for name, setting in settings(common).items()}
    return base, runs


@pytest.mark.parametrize("name", ["presence", "frequency", "repetition", "logit_bias",
                                  "min_tokens", "stop_token_ids"])
def test_processing_is_lossless(demo_models, prompts, common, plain_runs, name) -> None:
    opts, models = demo_models
    base, runs = plain_runs
    plain = runs[name]
    params, stop, eos = settings(common)[name]
    assert plain.tokens != base.tokens  # the setting is really at stake
    if name == "min_tokens":
        assert any(r is FinishReason.EOS for r in plain.reasons)
        assert all(len(t) >= 10 and not set(t[:10]) & set(eos) for t in plain.tokens)
    if name == "stop_token_ids":
        assert sum(r is FinishReason.STOP and len(t) > 2
                   for r, t in zip(plain.reasons, plain.tokens, strict=True)) >= 3
    for k in (1, 2, 3, 4):
        spec = generate(models, dataclasses.replace(opts, num_steps=k), prompts, params,
                        stop, True, eos=eos)
        assert spec.tokens == plain.tokens, f"K={k}"
        assert spec.reasons == plain.reasons
        assert spec.accepted > 0.1 * spec.drafted  # drafts were really at stake


@pytest.mark.parametrize("penalty", [0.0, 1.0])
def test_logprobs_equal_plain(demo_models, prompts, penalty) -> None:
    opts, models = demo_models
    params = SamplingParams(temperature=0.0, frequency_penalty=penalty, num_logprobs=5)
    stop = StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = generate(models, opts, prompts[:BATCH], params, stop, False)
    spec = generate(models, dataclasses.replace(opts, num_steps=3), prompts[:BATCH], params,
                    stop, True)
    assert spec.tokens == plain.tokens and spec.accepted > 0
    for toks, lp_spec, lp_plain in zip(plain.tokens, spec.logprobs, plain.logprobs,
                                       strict=True):
        assert [lp.token for lp in lp_spec] == toks == [lp.token for lp in lp_plain]
        for a, b in zip(lp_spec, lp_plain, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 5
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
            assert a.top[0][0] == a.token  # greedy picks the processed argmax

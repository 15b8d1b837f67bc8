"""The demo model's target loads unchanged in transformers, and chainspec's greedy output
(also through `chainspec generate --no-spec`) equals transformers' greedy `generate`."""

from __future__ import annotations

import pytest
import torch

from chainspec.cli import main
from chainspec.engine.local import DEMO_MODEL, build_verifier
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from tests import tools

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def hf_greedy(demo_tokenizer):
    transformers = tools.transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL,
                                                               dtype=torch.float32).eval()
    ids = torch.tensor([demo_tokenizer.encode(PROMPT)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_plain_engine_equals_transformers(demo_models, demo_tokenizer, hf_greedy):
    opts, models = demo_models
    eng = build_verifier(models, opts, speculative=False)
    result = run_to_completion(eng, [demo_tokenizer.encode(PROMPT)],
                               SamplingParams(temperature=0.0),
                               StopConditions(max_tokens=64))
    assert result.completions[0].tokens == hf_greedy


def test_generate_command_prints_the_same_completion(demo_tokenizer, hf_greedy, capsys):
    assert main(["generate", "--no-spec", "--prompt", PROMPT, "--max-tokens", "64"]) == 0
    printed = capsys.readouterr().out
    assert (PROMPT + demo_tokenizer.decode(hf_greedy)) in printed
    assert main(["generate", "--prompt", PROMPT, "--max-tokens", "64"]) == 0
    spec = capsys.readouterr().out
    assert (PROMPT + demo_tokenizer.decode(hf_greedy)) in spec
    assert "acceptance length" in spec

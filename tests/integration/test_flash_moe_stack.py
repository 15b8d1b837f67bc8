"""MiMo-V2-Flash and Step-3.5-Flash with MoE layers end to end (issue 21, must-shows 3-4):

- `chainspec serve` (Ray actors, a gRPC drafter, the HTTP gateway) with each family's
  native MTP layers: greedy output of 8 concurrent streams equals plain decoding by an
  in-process engine, and drafts were accepted past the first position;
- DESIGN 3.5 on the native MTP layers: per-position acceptance in the engine equals the
  offline simulation (`simulate_rounds`; MiMo-V2-Flash's does not chain, Step-3.5's does)
  within 0.02;
- `train-mtp` modules for a target of each family without MTP load in the family's own
  layout and are lossless at K = 1..4, batch 1/3/8.
Model directories: tests/integration/flash_moe_models.py."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.moe import SparseMoE
from chainspec.models.tokenizer import Tokenizer
from chainspec.training.evaluate import simulate_rounds
from chainspec.training.mtp_recipe import MTPRecipe, RunSettings
from chainspec.training.recipe import EvalSettings, StageSchedule
from chainspec.training.train_mtp import MTPJob, train_mtp
from tests.acceptance_audit import assert_acceptance_matches, engine_acceptance
from tests.integration import helpers
from tests.integration.family_models import declared_mtp, mtp_layout
from tests.integration.flash_moe_models import FAMILIES, write_family
from tests.integration.helpers import plain_outputs, prompt_ids, start_serve
from tests.integration.test_family_acceptance import audit_prompts, verifier
from tests.integration.test_family_serve import STREAMS, TOKENS, stream
from tests.integration.tiny_checkpoint import CORPUS
from tests.unit.engine_fixtures import outputs

pytestmark = pytest.mark.timeout(300)
K, MAX_NEW, MODULES = 3, 24, 2
LAYOUT = {"mimo_v2_flash_moe": {"model.mtp.layers.0", "model.mtp.layers.1"},
          "step3_moe": {"model.layers.4", "model.layers.5"}}  # N = 4 target layers


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    root = tmp_path_factory.mktemp("flash_moe_native")
    return {family: write_family(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_served_streams_equal_plain_decoding(ray_cluster, native, family):
    model_dir = native[family]
    assert any(isinstance(layer.mlp, SparseMoE) for layer in load_target(model_dir).model.layers)
    tok = Tokenizer.from_dir(model_dir)
    plain = [tok.decode(t) for t in plain_outputs(model_dir, prompt_ids(model_dir, STREAMS),
                                                  TOKENS)]
    namespace = f"chainspec-flash-moe-serve-{family}"
    served = start_serve(model_dir, namespace, "-k", str(K), "--max-seqs", str(STREAMS))
    try:
        assert "1 drafter(s) connected (speculative decoding on)" in served.output()
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        texts = [tok.decode(ids) for ids in prompt_ids(model_dir, STREAMS)]
        with ThreadPoolExecutor(STREAMS) as pool:
            got = list(pool.map(lambda p: stream(client, p), texts))
    finally:
        helpers.stop_serve(served, namespace, 60)
    assert [text for text, _ in got] == plain
    drafted = sum(s["draft_tokens"] for _, s in got)
    accepted = sum(s["accepted_tokens"] for _, s in got)
    per_pos = [sum(s["accepted_per_position"][i] for _, s in got) for i in range(K)]
    print(f"{family}: accepted {accepted}/{drafted} drafts, per position {per_pos}")
    assert accepted > 0.1 * drafted > 0, (accepted, drafted)
    assert per_pos[1] > 0, per_pos  # past the first draft too


@pytest.mark.parametrize("family", FAMILIES)
def test_native_acceptance_matches_the_offline_simulation(native, family):
    path = native[family]
    target, draft = load_target(path), load_draft_model(path)
    every = audit_prompts(path)
    chain = draft.glue.chains
    assert chain is (family == "step3_moe")  # MiMo-V2-Flash never chains
    offline = simulate_rounds(target, draft, every, K, MAX_NEW, chain=chain)
    assert min(offline.rates) > 0.05, offline.rates  # drafts at stake at every position
    got = engine_acceptance(verifier(target, draft), every, MAX_NEW)
    print(f"{family}: engine {[round(r, 3) for r in got.rates]}, "
          f"offline {[round(r, 3) for r in offline.rates]}")
    assert_acceptance_matches(got, offline)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """family -> train-mtp's output folder for a target of that family without MTP."""
    root, out = tmp_path_factory.mktemp("flash_moe_trained"), {}
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": CORPUS[i % 3][i:i + 6 + i % 5]}) + "\n"
                            for i in range(24)))
    settings = RunSettings(EvalSettings(windows=2, loss_windows=1, prompts=2, prompt_len=8,
                                        max_new_tokens=6), log_every=40, checkpoint_every=0,
                           threads=1)
    for family in FAMILIES:
        target = write_family(root / family, family, mtp=False)
        assert declared_mtp(target) == 0
        recipe = MTPRecipe(num_mtp=MODULES, schedule=StageSchedule(
            steps=40, lr=1e-2, warmup_steps=1, weight_decay=0.0), seq_len=32, batch_size=2,
            held_out_percent=30, seed=7, continue_tokens=24)
        out[family] = root / f"{family}-mtp"
        train_mtp(MTPJob(target, str(data), out[family], recipe, settings, False))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_modules_load_in_the_family_layout_and_are_lossless(trained, family):
    out = trained[family]
    assert mtp_layout(out) == LAYOUT[family]
    assert declared_mtp(out) == MODULES
    draft = load_draft_model(out)  # strict: every tensor found, no leftovers
    target, every = load_target(out), audit_prompts(out)[:8]
    plain, _ = outputs(verifier(target), every, MAX_NEW)
    for k in (1, 2, 3, 4):
        eng = verifier(target, draft, k)
        accepted = 0
        for lo, hi in ((0, 1), (1, 4), (0, 8)):
            got, result = outputs(eng, every[lo:hi], MAX_NEW)
            assert got == plain[lo:hi], (k, lo, hi)
            accepted += sum(c.stats.accepted_tokens for c in result.completions)
        assert accepted > 0, k  # drafts kept

"""The new families' drafters end to end (issue 20, "Lossless speculation" and
"Acceptance as correctness"):

- `train-mtp` (a tiny recipe on prompts the target continues itself) trains modules for
  a Qwen3.5, DeepSeek-V3 and MiMo-V2-Flash target; the output loads as a drafter in the
  family's own layout and block, and greedy speculative output equals plain at K = 1..4
  and batch 1/3/8;
- DESIGN 3.5 on the trained DeepSeek-V3 modules: per-position acceptance in the engine
  equals the offline simulation (`simulate_rounds`) within 0.02 in eager, static-buffer,
  local-drafter and remote-drafter (gRPC) modes;
- the remote-drafter mode for every family with native MTP weights; MiMo-V2-Flash's
  simulation does not chain (its glue says so, and its drafter never chains).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.factory import build_drafter
from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.runner import merged_stats
from chainspec.engine.verify_graphs import VerifyGraphs
from chainspec.models.attention import DenseCausal
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.mla import LatentAttention
from chainspec.models.sliding_attention import SlidingAttention
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.draft_pool import DrafterMatch, GrpcDraftClient
from chainspec.training.evaluate import simulate_rounds
from chainspec.training.mtp_model import TargetWithMTP
from chainspec.training.mtp_recipe import MTPRecipe, RunSettings
from chainspec.training.objective import run_model
from chainspec.training.recipe import EvalSettings, StageSchedule
from chainspec.training.train_mtp import MTPJob, train_mtp
from tests.acceptance_audit import assert_acceptance_matches, engine_acceptance
from tests.integration.family_models import FAMILIES, declared_mtp, mtp_layout, write_family
from tests.integration.grpc_helpers import start_drafter
from tests.integration.tiny_checkpoint import CORPUS
from tests.unit.engine_fixtures import RandomDepth, engine, outputs

pytestmark = pytest.mark.timeout(300)
K, MAX_NEW, BLOCK, CHUNK = 3, 24, 4, 5
# Qwen3.5's layout holds one MTP layer (mtp.fc, mtp.norm are not per layer)
MODULES = {"qwen3_5": 1, "deepseek_v3": 2, "mimo_v2_flash": 2, "qwen3_next": 1,
           "qwen3_5_moe": 1}
QWEN_MTP = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight", "mtp.layers.0"}
LAYOUT = {"qwen3_5": QWEN_MTP, "qwen3_next": QWEN_MTP, "qwen3_5_moe": QWEN_MTP,
          "deepseek_v3": {"model.layers.2", "model.layers.3"},
          "mimo_v2_flash": {"model.mtp.layers.0", "model.mtp.layers.1"}}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Short prompts from the corpus; train-mtp trains on the target's continuations."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": CORPUS[i % 3][i:i + 6 + i % 5]}) + "\n"
                            for i in range(24)))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data):
    """family -> train-mtp's output folder for a target of that family without MTP."""
    root, out = tmp_path_factory.mktemp("trained"), {}
    settings = RunSettings(EvalSettings(windows=2, loss_windows=1, prompts=2, prompt_len=8,
                                        max_new_tokens=6), log_every=40, checkpoint_every=0,
                           threads=1)
    for family in FAMILIES:
        target = write_family(root / family, family, mtp=False)
        assert declared_mtp(target) == 0
        recipe = MTPRecipe(num_mtp=MODULES[family], schedule=StageSchedule(
            steps=40, lr=1e-2, warmup_steps=1, weight_decay=0.0), seq_len=32, batch_size=2,
            held_out_percent=30, seed=7, continue_tokens=24)
        out[family] = root / f"{family}-mtp"
        train_mtp(MTPJob(target, str(data), out[family], recipe, settings, False))
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {family: write_family(root / family, family) for family in FAMILIES}


def audit_prompts(model_dir) -> list[list[int]]:
    """Corpus snippets and token-salad prompts (lengths 2..12 over chunks of 5): 12."""
    tok = Tokenizer.from_dir(model_dir)
    gen = torch.Generator().manual_seed(7)
    vocab = tok.vocab_size
    salad = [torch.randint(0, vocab, (n,), generator=gen).tolist()
             for n in (2, 7, 11, 5, 9, 3, 12, 6, 8)]
    return [tok.encode(c)[:12] for c in CORPUS[:3]] + salad


def verifier(target, draft=None, k: int = K, client=None):
    kv = KVBudget(block_size=BLOCK)
    return engine(target, draft, k=k, chain=True, chunk=CHUNK, kv=kv, drafter_kv=kv,
                  client=client, sampled_drafts=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_train_mtp_output_loads_in_the_family_layout(trained, family):
    out = trained[family]
    assert mtp_layout(out) == LAYOUT[family]
    assert declared_mtp(out) == MODULES[family]
    draft = load_draft_model(out)  # strict: every tensor found, no leftovers
    assert draft.num_modules == MODULES[family]
    attn = draft.mtp[0].block.self_attn
    if family == "deepseek_v3":
        assert isinstance(attn, LatentAttention)
    elif family == "mimo_v2_flash":
        assert isinstance(attn, SlidingAttention) and not draft.glue.chains
    else:
        assert attn.output_gate and draft.glue.chains


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_speculative_equals_plain(trained, family):
    """Per K: one prompt alone, three together, then all eight in one batch."""
    out = trained[family]
    target, every = load_target(out), audit_prompts(out)[:8]
    plain, _ = outputs(verifier(target), every, MAX_NEW)
    draft = load_draft_model(out)
    for k in (1, 2, 3, 4):
        eng = verifier(target, draft, k)
        stats = []
        for lo, hi in ((0, 1), (1, 4), (0, 8)):
            got, result = outputs(eng, every[lo:hi], MAX_NEW)
            assert got == plain[lo:hi], (k, lo, hi)
            stats += result.completions
        merged = merged_stats(stats, k)
        assert merged.accepted_per_pos[min(k, 2) - 1] > 0, (k, merged)  # drafts kept
    # drafter-side depth (4.11): random verified depths and rounds of 1..4 draft steps,
    # steps left lagging and caught up, in the family's own MTP blocks and caches
    eng = verifier(target, draft, 4)
    eng.depth = RandomDepth(len(family), 4)
    got, _ = outputs(eng, every, MAX_NEW)
    assert got == plain
    assert {1, 4} <= set(eng.depth.rounds)


def test_train_mtp_runs_non_chained_steps_as_the_drafter_drafts(native):
    """MiMo-V2-Flash's steps all read h: train-mtp's forward (its losses and its
    teacher-forced acceptance) feeds step 2 h, not g[1], as the drafter will."""
    target = load_target(native["mimo_v2_flash"])
    model = TargetWithMTP(target, 2)
    model.init_mtp(seed=3, std=0.3)
    ids = torch.tensor([audit_prompts(native["mimo_v2_flash"])[0]])
    n = ids.shape[1]
    with torch.no_grad():
        fwd = run_model(model, ids)
        h = target(ids[0], torch.arange(n), DenseCausal(1, n))
        x2 = torch.cat([ids[0, 2:], ids.new_zeros(2)])
        g2 = model.draft.step(2, x2, h, torch.arange(n), DenseCausal(1, n))
        want = model.draft.logits(2, g2)
    torch.testing.assert_close(fwd.mtp_logits[1][0], want)


# --- DESIGN 3.5 on the trained DeepSeek-V3 modules, in every mode ----------------------

@pytest.fixture(scope="module")
def deepseek(trained):
    out = trained["deepseek_v3"]
    opts = LocalOptions(out, num_steps=K, max_seqs=4, max_len=256, kv_block_size=BLOCK)
    models = load_models(opts, speculative=True)
    every = audit_prompts(out)
    offline = simulate_rounds(models.target, models.draft, every, K, MAX_NEW)
    print(f"trained deepseek_v3 offline rates {[round(r, 3) for r in offline.rates]}")
    assert min(offline.rates) > 0.05  # drafts at stake at every position
    return opts, models, every, offline


def remote_client(loop, draft, opts: LocalOptions, target):
    drafter = build_drafter(copy.deepcopy(draft), opts.for_drafter())
    server = start_drafter(loop, drafter)
    client = GrpcDraftClient([server.address], round_deadline_s=10.0,
                             match=DrafterMatch(opts.num_steps, target.config.hidden_size,
                                                target.config.vocab_size))
    return server, client


@pytest.mark.parametrize("mode", ["eager", "static", "local", "remote"])
def test_trained_acceptance_matches_the_offline_simulation(deepseek, loop, mode):
    opts, models, every, offline = deepseek
    server = None
    if mode == "local":  # as `chainspec generate` builds the pair
        eng = build_verifier(models, opts, speculative=True)
    else:
        if mode == "remote":
            server, client = remote_client(loop, models.draft, opts, models.target)
        else:
            drafter = build_drafter(copy.deepcopy(models.draft), opts.for_drafter())
            if mode == "eager":
                drafter.runner.fits = lambda windows: False  # every round packed
            client = LocalDraftClient(drafter)
        eng = build_verifier(dataclasses.replace(models, draft=None), opts, speculative=False)
        eng.drafter = client
        if mode == "static":  # verify steps on the static buffers the CUDA graphs replay
            eng.graphs = VerifyGraphs(eng.model, eng.cache, opts.max_seqs, K, opts.max_len,
                                      use_graphs=False, static_on_cpu=True)
    try:
        got = engine_acceptance(eng, every, MAX_NEW)
    finally:
        if server is not None:
            client.close()
            loop.run(server.stop(0))
    print(f"{mode}: engine rates {[round(r, 3) for r in got.rates]}")
    assert_acceptance_matches(got, offline)


# --- the remote-drafter mode for every family's native MTP layers ----------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_native_remote_drafter_matches_the_offline_simulation(native, loop, family):
    path = native[family]
    target, draft = load_target(path), load_draft_model(path)
    every = audit_prompts(path)
    chain = draft.glue.chains  # MiMo-V2-Flash: False, and its drafter never chains
    assert chain is (family != "mimo_v2_flash")
    offline = simulate_rounds(target, draft, every, K, MAX_NEW, chain=chain)
    assert min(offline.rates) > 0.05, offline.rates  # drafts at stake at every position
    opts = LocalOptions(path, num_steps=K, max_seqs=4, max_len=256, kv_block_size=BLOCK)
    server, client = remote_client(loop, draft, opts, target)
    try:
        got = engine_acceptance(verifier(target, client=client), every, MAX_NEW)
    finally:
        client.close()
        loop.run(server.stop(0))
    print(f"{family} remote: engine {[round(r, 3) for r in got.rates]}, "
          f"offline {[round(r, 3) for r in offline.rates]}")
    assert_acceptance_matches(got, offline)

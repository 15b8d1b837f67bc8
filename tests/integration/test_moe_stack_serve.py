"""`chainspec serve` (Ray actors, a gRPC drafter, the HTTP gateway) for GLM-4.5 with its
native NextN layer (`model.layers.{N}`, a MoE block) and for Qwen3-MoE with the modules
`train-mtp` writes for it (DeepSeek layout, the family's MoE block): greedy output of 8
concurrent streams equals plain decoding by an in-process engine, and drafts were
accepted past the first position. The trained modules are also lossless in the engine at
K = 1..4, batch 1/3/8, and with each family's drafter behind gRPC, engine acceptance
equals the offline simulation within 0.02 (DESIGN 3.5). One stack per family on the
session's Ray, each in its own namespace."""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from chainspec.engine.factory import build_drafter
from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.local import LocalOptions
from chainspec.engine.runner import merged_stats
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.moe import SparseMoE
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.draft_pool import DrafterMatch, GrpcDraftClient
from chainspec.training.evaluate import simulate_rounds
from chainspec.training.mtp_recipe import MTPRecipe, RunSettings
from chainspec.training.recipe import EvalSettings, StageSchedule
from chainspec.training.train_mtp import MTPJob, train_mtp
from tests.acceptance_audit import assert_acceptance_matches, engine_acceptance
from tests.integration import helpers
from tests.integration.grpc_helpers import start_drafter
from tests.integration.helpers import plain_outputs, prompt_ids, start_serve
from tests.integration.tiny_checkpoint import CORPUS, write_tokenizer
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families.moe_stack_checkpoint import QUIET, write_target, write_with_mtp

pytestmark = pytest.mark.timeout(300)
TOKENS, STREAMS, K = 12, 8, 3


def shape(path: Path) -> dict:
    eot = write_tokenizer(path, 300)
    vocab = HFTokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    return dict(vocab_size=vocab, eos_token_id=eot, bos_token_id=eot)


def native_glm(path: Path) -> Path:
    write_with_mtp(path, "glm4_moe", agreeing=True, **shape(path))
    return path


def trained_qwen(root: Path) -> Path:
    """train-mtp (a tiny recipe on prompts the quiet target continues itself) for a
    Qwen3-MoE target that ships no MTP layers."""
    target, out, data = root / "target", root / "mtp", root / "prompts.jsonl"
    write_target(target, "qwen3_moe", quiet=QUIET, **shape(target))
    data.write_text("".join(json.dumps({"prompt": CORPUS[i % 3][i:i + 6 + i % 5]}) + "\n"
                            for i in range(24)))
    settings = RunSettings(EvalSettings(windows=2, loss_windows=1, prompts=2, prompt_len=8,
                                        max_new_tokens=6), log_every=40, checkpoint_every=0,
                           threads=1)
    recipe = MTPRecipe(num_mtp=2, schedule=StageSchedule(steps=40, lr=1e-2, warmup_steps=1,
                                                         weight_decay=0.0),
                       seq_len=32, batch_size=2, held_out_percent=30, seed=7,
                       continue_tokens=24)
    train_mtp(MTPJob(target, str(data), out, recipe, settings, False))
    return out


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("moe_stack")
        yield {"glm4_moe": native_glm(root / "glm4_moe"),
               "qwen3_moe": trained_qwen(root / "qwen3_moe")}
    finally:
        torch.set_num_threads(threads)


def test_trained_qwen3_moe_modules_are_lossless(moe_models):
    """train-mtp's output: two MoE blocks at model.layers.{N}, {N+1}; speculative ==
    plain per K, one prompt alone, three together, all eight in one batch."""
    path = moe_models["qwen3_moe"]
    draft = load_draft_model(path)
    assert draft.num_modules == 2 and isinstance(draft.mtp[1].block.mlp, SparseMoE)
    target, every = load_target(path), prompt_ids(path, STREAMS)
    kv = KVBudget(block_size=4)
    plain, _ = outputs(engine(target, kv=kv, chunk=5), every, 16)
    for k in (1, 2, 3, 4):
        eng = engine(target, draft, k=k, chunk=5, kv=kv, drafter_kv=kv, sampled_drafts=False)
        stats = []
        for lo, hi in ((0, 1), (1, 4), (0, 8)):
            got, result = outputs(eng, every[lo:hi], 16)
            assert got == plain[lo:hi], (k, lo, hi)
            stats += result.completions
        assert merged_stats(stats, k).accepted_per_pos[0] > 0, k


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_moe"])
def test_remote_drafter_acceptance_matches_the_offline_simulation(moe_models, loop, family):
    """DESIGN 3.5 with the drafter behind gRPC: per-position acceptance equals
    `simulate_rounds` of the same modules within 0.02."""
    path = moe_models[family]
    target, draft = load_target(path), load_draft_model(path)
    every = prompt_ids(path, STREAMS)
    offline = simulate_rounds(target, draft, every, K, 16)
    assert min(offline.rates) > 0.02, offline.rates  # drafts at stake at every position
    opts = LocalOptions(path, num_steps=K, max_seqs=4, max_len=256, kv_block_size=4)
    server = start_drafter(loop, build_drafter(copy.deepcopy(draft), opts.for_drafter()))
    client = GrpcDraftClient([server.address], round_deadline_s=10.0,
                             match=DrafterMatch(K, target.config.hidden_size,
                                                target.config.vocab_size))
    try:
        kv = KVBudget(block_size=4)
        eng = engine(target, k=K, chunk=5, kv=kv, client=client, sampled_drafts=False)
        got = engine_acceptance(eng, every, 16)
    finally:
        client.close()
        loop.run(server.stop(0))
    print(f"{family} remote: engine {[round(r, 3) for r in got.rates]}, "
          f"offline {[round(r, 3) for r in offline.rates]}")
    assert_acceptance_matches(got, offline)


def stream(client: openai.OpenAI, prompt: str) -> tuple[str, dict]:
    text, usage = "", None
    for chunk in client.completions.create(
            model=openai.NOT_GIVEN, prompt=prompt, max_tokens=TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}):
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    return text, usage.model_extra["speculative"]


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_moe"])
def test_served_streams_equal_plain_decoding(ray_cluster, moe_models, family):
    model_dir = moe_models[family]
    tok = Tokenizer.from_dir(model_dir)
    plain = [tok.decode(t) for t in plain_outputs(model_dir, prompt_ids(model_dir, STREAMS),
                                                  TOKENS)]
    namespace = f"chainspec-moe-serve-{family}"
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
    assert accepted > 0.1 * drafted > 0, (accepted, drafted)
    per_pos = [sum(s["accepted_per_position"][i] for _, s in got) for i in range(K)]
    assert per_pos[1] > 0, per_pos  # past the first draft too
    print(f"{family}: accepted {accepted}/{drafted} drafts, per position {per_pos}")

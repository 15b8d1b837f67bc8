"""`chainspec train-mtp` with 2 data parallel Ray Train workers (gloo, CPU) equals one
process with the same global batch: DDP averages the gradients, the two ranks' shares of
each batch are disjoint and together the whole batch, the logged metrics are the global
means, and rank 0 alone writes a folder that loads as a drafter."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chainspec.models.loader import load_draft_model
from chainspec.training.batches import WindowSampler
from chainspec.training.mtp_recipe import MTPRecipe, RunSettings
from chainspec.training.recipe import EvalSettings, StageSchedule
from chainspec.training.train_mtp import MTPJob, train_mtp
from tests.integration.tiny_checkpoint import CORPUS, write_tiny_model
from tests.unit.test_train_mtp import _strip_mtp

PER_WORKER = 2
RECIPE = MTPRecipe(num_mtp=2, schedule=StageSchedule(steps=4, lr=1e-2, warmup_steps=1,
                                                     weight_decay=0.0),
                   seq_len=24, batch_size=PER_WORKER, grad_accum=2, held_out_percent=30,
                   seed=11)
SETTINGS = RunSettings(EvalSettings(windows=1, loss_windows=1, prompts=1, prompt_len=6,
                                    max_new_tokens=4), log_every=2, checkpoint_every=2,
                       threads=1)


@pytest.fixture(scope="module", autouse=True)
def train_polls_often():
    """Ray Train's controller polls its workers every 2 s by default, so each phase of a
    run (group started, step reports, workers done) waits up to 2 s more; a run here takes
    seconds. The driver's value reaches the controller and workers (Ray Train
    propagates RAY_TRAIN_HEALTH_CHECK_INTERVAL_S)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
        yield


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = _strip_mtp(write_tiny_model(tmp_path_factory.mktemp("target"), num_mtp=1))
    corpus = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(CORPUS[i % 3] * 2)
    return target, corpus


def test_shards_are_disjoint_and_make_the_global_batch() -> None:
    stream = torch.arange(1000)
    whole = WindowSampler(stream, 8, 6, seed=3)
    ranks = [WindowSampler(stream, 8, 2, seed=3, rank=r, world=3) for r in range(3)]
    for _ in range(3):
        assert torch.equal(torch.cat([s.next() for s in ranks]), whole.next())
    assert all(torch.equal(s.generator.get_state(), whole.generator.get_state())
               for s in ranks)


@pytest.fixture(scope="module")
def two_workers(ray_cluster, inputs: tuple[Path, Path],
                tmp_path_factory: pytest.TempPathFactory):
    target, corpus = inputs
    before = _digests(target)
    job = MTPJob(target, str(corpus), tmp_path_factory.mktemp("two"),
                 replace(RECIPE, workers=2), SETTINGS)
    report = train_mtp(job)
    assert _digests(target) == before  # the target files stay untouched
    return job, report


def test_two_workers_equal_one_process_with_the_global_batch(
        two_workers, inputs: tuple[Path, Path], tmp_path: Path) -> None:
    target, corpus = inputs
    job, report = two_workers
    one = MTPJob(target, str(corpus), tmp_path / "one",
                 replace(RECIPE, batch_size=2 * PER_WORKER), SETTINGS)
    single = train_mtp(one)

    a = load_file(str(job.out / "mtp.safetensors"))
    b = load_file(str(tmp_path / "one" / "mtp.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)
    for r2, r1 in zip(report.log, single.log, strict=True):
        assert (r2.step, r2.split) == (r1.step, r1.split)
        for key, value in r1.metrics.items():
            assert r2.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert sorted(p.name for p in (job.out / "checkpoints").iterdir()) == [
        "step-0000002.pt", "step-0000004.pt"]  # rank 0's; Ray Train's storage removed
    assert load_draft_model(job.out).num_modules == 2
    assert "2 data parallel worker(s)" in (job.out / "README.md").read_text()


def test_resumed_two_worker_run_ends_where_the_whole_run_did(
        two_workers, tmp_path: Path) -> None:
    """Every rank resumes from rank 0's checkpoint (step 2) and draws the same batches."""
    job, _ = two_workers
    out = tmp_path / "resumed"
    shutil.copytree(job.out, out, symlinks=True)
    (out / "checkpoints" / "step-0000004.pt").unlink()
    report = train_mtp(replace(job, out=out, resume=True))
    assert report.resumed_from == 2
    whole = load_file(str(job.out / "mtp.safetensors"))
    again = load_file(str(out / "mtp.safetensors"))
    assert all(torch.equal(whole[k], again[k]) for k in whole)

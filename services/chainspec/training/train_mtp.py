"""`chainspec train-mtp`: K chained MTP modules for a frozen target of any supported
family, trained by self-distillation (the distill stage, `distill.py`), written beside
the target in the DeepSeek-V3 layout, measured on held-out data, with a model card.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.tokenizer import Tokenizer
from chainspec.training import evaluate, mtp_card, mtp_export, resume
from chainspec.training.batches import WindowSampler, consecutive_windows
from chainspec.training.distill import distill_stage
from chainspec.training.mtp_checks import check_job
from chainspec.training.mtp_data import TokenData, tokenize
from chainspec.training.mtp_model import TargetWithMTP
from chainspec.training.mtp_recipe import MTPRecipe, RunSettings
from chainspec.training.progress import ProgressBar
from chainspec.training.stage import LogRow, StageState
from chainspec.training.text_corpus import read_corpus
from chainspec.training.trainer import held_out_row


@dataclass(frozen=True)
class MTPJob:
    target: Path
    data: str
    out: Path
    recipe: MTPRecipe
    settings: RunSettings
    resume: bool = False
    command: str = "chainspec train-mtp"


@dataclass(frozen=True)
class MTPReport:
    job: MTPJob
    architecture: str
    python: str
    data: dict[str, int]
    params: dict[str, int]
    log: tuple[LogRow, ...]
    seconds: dict[str, float]
    resumed_from: int  # step of the checkpoint this run resumed from (0: none)
    teacher_forced: evaluate.Acceptance
    simulated: evaluate.Acceptance
    simulated_prompts: int


def build_model(job: MTPJob) -> TargetWithMTP:
    """The frozen target as its loader reads it, plus freshly initialised MTP modules."""
    dtype = torch.bfloat16 if job.settings.bf16 else torch.float32
    target = load_target(job.target, dtype=dtype, device=job.settings.device)
    model = TargetWithMTP(target, job.recipe.num_mtp)
    model.draft.mtp.to(device=job.settings.device, dtype=torch.float32)
    model.draft.rotaries.to(job.settings.device)
    model.init_mtp(job.recipe.seed)
    return model


def prepare_data(job: MTPJob, model: TargetWithMTP) -> TokenData:
    corpus = read_corpus(job.data, job.recipe.held_out_percent)
    return tokenize(corpus, Tokenizer.from_dir(job.target), model.target,
                    job.recipe.continue_tokens, job.recipe.seed + 3)


def train_modules(job: MTPJob, model: TargetWithMTP, data: TokenData, started: float,
                  rank: int = 0) -> tuple[list[LogRow], int]:
    """The distill stage, resumable. Returns (log rows, step resumed from). With
    `recipe.workers` > 1 this process is rank `rank` of a torch.distributed group: every
    rank resumes from the same checkpoint; only rank 0 writes them and evaluates."""
    r, s = job.recipe, job.settings
    sampler = WindowSampler(data.train_stream, r.seq_len, r.batch_size, r.seed + 1,
                            rank, r.workers)
    folder = resume.checkpoint_dir(job.out)
    found = resume.latest(folder) if job.resume else None
    state = resume.load(found, model, r) if found else None
    first = state.step if state else 0
    if found and rank == 0:
        print(f"resuming from {found} (step {first})", flush=True)
    stage = distill_stage(model, r.schedule, r.grad_accum,
                          torch.bfloat16 if s.bf16 else None, data_parallel=r.workers > 1)
    bar = ProgressBar(r.schedule.steps, first)

    def on_step(step: int, metrics: dict[str, float], snapshot) -> None:
        if rank != 0:
            return
        bar.update(step, metrics)
        if s.checkpoint_every and step % s.checkpoint_every == 0:
            state_now: StageState = snapshot()
            resume.save(folder, model, r, state_now, s.keep_checkpoints)

    rows = stage.run(model, sampler, 0, s.log_every, started, state, on_step)
    if rank != 0:
        return rows, first
    windows = consecutive_windows(data.held_out_stream, r.seq_len, s.eval.loss_windows)
    with torch.autocast(torch.device(s.device).type, torch.bfloat16, enabled=s.bf16):
        rows.append(held_out_row(model, windows, "distill", r.schedule.steps, 0.0, started))
    return rows, first


def stored_model(job: MTPJob) -> TargetWithMTP:
    """The written folder read back by chainspec's own loaders (as every command does)."""
    target = load_target(job.out, device=job.settings.device)
    draft = load_draft_model(job.out, device=job.settings.device)
    model = TargetWithMTP(target, draft.num_modules)
    model.draft.mtp.load_state_dict(draft.mtp.state_dict(), strict=True)
    return model.to(job.settings.device).eval()


def measure(job: MTPJob, data: TokenData
            ) -> tuple[evaluate.Acceptance, evaluate.Acceptance, int]:
    stored, e = stored_model(job), job.settings.eval
    windows = consecutive_windows(data.held_out_stream, job.recipe.seq_len, e.windows)
    tf = evaluate.teacher_forced(stored, windows)
    print(f"teacher-forced: rates={_fmt(tf.rates)} mean_len={tf.mean_length:.3f}", flush=True)
    prompts = evaluate.held_out_prompts(list(data.held_out_docs), e.prompts, e.prompt_len,
                                        data.sep, job.recipe.seed + 2)
    sim = evaluate.simulate(stored, prompts, e.max_new_tokens, data.eos[0])
    print(f"simulated: rates={_fmt(sim.rates)} mean_len={sim.mean_length:.3f}", flush=True)
    return tf, sim, len(prompts)


def train_mtp(job: MTPJob) -> MTPReport:
    """One process, or `recipe.workers` Ray Train workers (`ray_launch`), once every
    argument has been checked (`mtp_checks`: before any corpus or model is loaded)."""
    check_job(job)
    if job.recipe.workers > 1:
        from chainspec.training.ray_launch import train_on_ray
        return train_on_ray(job)
    report = train_rank(job)
    assert report is not None
    return report


def train_rank(job: MTPJob, rank: int = 0) -> MTPReport | None:
    """The whole run as one rank sees it; rank 0 writes the output and its report, the
    other ranks only train (and return None)."""
    started = time.monotonic()
    mtp_export.check_target(job.target, job.out)
    torch.manual_seed(job.recipe.seed)
    model = build_model(job)
    data = prepare_data(job, model)
    seconds = {"data": time.monotonic() - started}
    if rank == 0:
        print(f"data: {data.stats} ({seconds['data']:.0f}s)", flush=True)
    t0 = time.monotonic()
    rows, first = train_modules(job, model, data, started, rank)
    seconds["training"] = time.monotonic() - t0
    if rank != 0:
        return None
    mtp_export.write_folder(model, job.target, job.out, job.settings.copy_target)
    t0 = time.monotonic()
    tf, sim, prompts = measure(job, data)
    seconds["evaluation"] = time.monotonic() - t0
    seconds["total"] = time.monotonic() - started
    report = MTPReport(job, model.config.architecture, platform.python_version(),
                       data.stats, param_counts(model), tuple(rows), seconds, first, tf,
                       sim, prompts)
    (job.out / "README.md").write_text(mtp_card.render(report))
    return report


def param_counts(model: TargetWithMTP) -> dict[str, int]:
    counts = {"target (frozen)": sum(p.numel() for p in model.target.parameters())}
    counts.update({f"mtp module {i + 1}": sum(p.numel() for p in m.parameters())
                   for i, m in enumerate(model.draft.mtp)})
    return counts


def _fmt(values: tuple[float, ...]) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"

"""Train the demo model end to end: corpus, BPE, joint stage, distill stage, export,
acceptance on the stored weights, model card.

    python -m chainspec.training.trainer --out services/chainspec/assets/demo
    chainspec train-demo --out services/chainspec/assets/demo   (same entry point)
"""

from __future__ import annotations

import argparse
import functools
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from chainspec.training import evaluate, model_card
from chainspec.training.batches import WindowSampler, consecutive_windows
from chainspec.training.bpe import write_tokenizer_files
from chainspec.training.data import PreparedData, prepare
from chainspec.training.demo_model import DemoModel
from chainspec.training.distill import distill_stage
from chainspec.training.export import load_model, write_weights
from chainspec.training.objective import distill_loss, joint_loss, run_model
from chainspec.training.recipe import PRESETS, Recipe, with_steps
from chainspec.training.stage import LogRow, Stage
from chainspec.training.trainer_args import build_parser


@dataclass(frozen=True)
class TrainReport:
    command: str
    recipe: Recipe
    python: str
    stdlib_root: str
    data: dict[str, int]
    params: dict[str, int]
    log: tuple[LogRow, ...]
    stage_seconds: dict[str, float]
    teacher_forced: evaluate.Acceptance
    simulated: evaluate.Acceptance
    simulated_tokens: int
    files: dict[str, int]  # file name -> bytes


@torch.no_grad()
def held_out_row(model: DemoModel, windows: torch.Tensor, stage: str, step: int,
                 mtp_weight: float, started: float) -> LogRow:
    model.eval()
    parts = []
    for ids in windows.to(model.device).split(4):
        fwd = run_model(model, ids)
        metrics = joint_loss(fwd, ids, mtp_weight)[1] | distill_loss(fwd, ids)[1]
        parts.append(metrics)
    mean = {k: sum(m[k] for m in parts) / len(parts) for k in parts[0]}
    shown = " ".join(f"{k}={v:.3f}" for k, v in mean.items())
    print(f"[{stage}] held-out after step {step}: {shown}", flush=True)
    return LogRow(stage, step, "held-out", time.monotonic() - started, mean)


def param_counts(model: DemoModel) -> dict[str, int]:
    counts = {"target": sum(p.numel() for p in model.target.parameters()),
              "embedding (shared, tied head)": model.target.lm_head.weight.numel()}
    counts.update({f"mtp module {i + 1}": sum(p.numel() for p in m.parameters())
                   for i, m in enumerate(model.draft.mtp)})
    return counts


def train_stages(model: DemoModel, data: PreparedData, recipe: Recipe, started: float
                 ) -> tuple[list[LogRow], dict[str, float]]:
    d = recipe.data
    sampler = WindowSampler(data.train_stream, d.seq_len, d.batch_size, recipe.seed + 1)
    loss_windows = consecutive_windows(data.held_out_stream, d.seq_len,
                                       recipe.eval.loss_windows)
    joint = Stage("joint", recipe.joint, list(model.parameters()),
                  functools.partial(joint_loss, mtp_weight=recipe.mtp_weight), True)
    rows, seconds, step = [], {}, 0
    for make in (lambda: joint, lambda: distill_stage(model, recipe.distill)):
        stage = make()  # NOTE: distill_stage freezes the target, so build it after joint
        t0 = time.monotonic()
        rows += stage.run(model, sampler, step, recipe.log_every, started)
        seconds[stage.name] = time.monotonic() - t0
        step += stage.schedule.steps
        rows.append(held_out_row(model, loss_windows, stage.name, step, recipe.mtp_weight,
                                 started))
    return rows, seconds


def measure(model_dir: Path, data: PreparedData, recipe: Recipe
            ) -> tuple[evaluate.Acceptance, evaluate.Acceptance, int]:
    """Acceptance of the weights as stored (bf16 read back to fp32)."""
    stored = load_model(model_dir)
    e = recipe.eval
    windows = consecutive_windows(data.held_out_stream, recipe.data.seq_len, e.windows)
    tf = evaluate.teacher_forced(stored, windows)
    print(f"teacher-forced: rates={tf.rates} mean_len={tf.mean_length:.3f}", flush=True)
    prompts = evaluate.held_out_prompts(list(data.held_out_docs), e.prompts, e.prompt_len,
                                        data.eot, recipe.seed + 2)
    sim = evaluate.simulate(stored, prompts, e.max_new_tokens, data.eot)
    print(f"simulated: rates={sim.rates} mean_len={sim.mean_length:.3f}", flush=True)
    return tf, sim, len(prompts)


def train(recipe: Recipe, out_dir: Path, command: str, stdlib: Path | None = None
          ) -> TrainReport:
    started = time.monotonic()
    torch.manual_seed(recipe.seed)
    data = prepare(recipe, stdlib)
    print(f"data: {data.stats()} ({time.monotonic() - started:.0f}s)", flush=True)
    model = DemoModel(recipe.shape.model_config(data.eot), recipe.shape.num_mtp)
    model.init_weights(recipe.seed)
    rows, seconds = train_stages(model, data, recipe, started)
    write_weights(model, out_dir)
    write_tokenizer_files(data.tokenizer, out_dir, recipe.shape.max_position)
    t0 = time.monotonic()
    tf, sim, prompts = measure(out_dir, data, recipe)
    seconds["evaluation"] = time.monotonic() - t0
    seconds["total"] = time.monotonic() - started
    files = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file()
             and p.name != "README.md"}
    report = TrainReport(command, recipe, platform.python_version(), data.split.root,
                         data.stats(), param_counts(model), tuple(rows), seconds, tf, sim,
                         prompts, files)
    (out_dir / "README.md").write_text(model_card.render(report))
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m chainspec.training.trainer`. Returns the exit status."""
    args = build_parser().parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    return run(args, "python -m chainspec.training.trainer " + shlex.join(argv))


def run(args: argparse.Namespace, command: str) -> int:
    """Train with parsed arguments; `command` is recorded in the model card."""
    recipe = with_steps(PRESETS[args.preset], args.joint_steps, args.distill_steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = train(recipe, args.out, command, args.stdlib)
    finally:
        torch.set_num_threads(threads)  # callers in the same process keep theirs
    print(f"wrote {args.out} in {report.stage_seconds['total']:.0f}s; mean acceptance "
          f"length {report.simulated.mean_length:.2f} (simulated), "
          f"{report.teacher_forced.mean_length:.2f} (teacher-forced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`chainspec train-mtp`: train chained MTP modules for a frozen target (see
`chainspec.training.train_mtp`)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from chainspec.commands.help_format import DefaultsHelpFormatter
from chainspec.training.mtp_recipe import MTPRecipe, RunSettings
from chainspec.training.recipe import EvalSettings, StageSchedule

DESCRIPTION = """\
Train K chained MTP modules (DeepSeek-V3 layout, sharing the target's embedding and head)
by self-distillation against a frozen target of any supported family, and write them
beside it in --out.

Time: the defaults (1400 steps of 2 x 512 tokens, K = 3) took 19.6 min with the demo
target and --data stdlib on 2 idle CPU cores (benchmarks/results/train_mtp/README.md):
budget about 45 minutes on a 2-core machine shared with other work. On one H200
(--device cuda --bf16) training took 0.7 min. Every argument is checked before the
corpus or the model is loaded."""


def add_parser(sub) -> list[str]:
    p = sub.add_parser("train-mtp", help="train an MTP drafter for a model without one",
                       description=DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="the target model folder")
    p.add_argument("--data", required=True,
                   help="'stdlib' (the demo corpus), a directory of text files, a .jsonl "
                        "file ({'text': ...} or {'prompt': ...} per line) or a text file")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    d = MTPRecipe()
    p.add_argument("-k", "--num-mtp", type=int, default=d.num_mtp, help="MTP modules (K)")
    p.add_argument("--steps", type=int, default=d.schedule.steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=d.schedule.lr,
                   help="peak learning rate (AdamW, cosine decay)")
    p.add_argument("--warmup-steps", type=int, default=d.schedule.warmup_steps,
                   help="linear warmup")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help="tokens per training window (at most the target's positions)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="windows per batch (per worker)")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help="batches per optimizer step")
    p.add_argument("--held-out-percent", type=int, default=d.held_out_percent,
                   help="documents held out for evaluation")
    p.add_argument("--continue-tokens", type=int, default=d.continue_tokens,
                   help="tokens the target writes after each JSONL 'prompt'")
    p.add_argument("--seed", type=int, default=d.seed, help="initialisation, batches, split")
    _add_run_args(p)
    return ["train-mtp"]


def _add_run_args(p: argparse.ArgumentParser) -> None:
    r, e = RunSettings(), EvalSettings()
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in OUT/checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=r.checkpoint_every,
                   help="steps between checkpoints (0: none)")
    p.add_argument("--log-every", type=int, default=r.log_every, help="steps between log rows")
    p.add_argument("--eval-windows", type=int, default=e.windows,
                   help="held-out windows for the teacher-forced acceptance")
    p.add_argument("--eval-prompts", type=int, default=e.prompts,
                   help="held-out prompts for the simulated acceptance")
    p.add_argument("--eval-prompt-len", type=int, default=e.prompt_len,
                   help="tokens per evaluation prompt")
    p.add_argument("--eval-new-tokens", type=int, default=e.max_new_tokens,
                   help="tokens generated per evaluation prompt")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: on for CUDA)")
    p.add_argument("--threads", type=int, default=r.threads, help="torch CPU threads")
    p.add_argument("--copy-target", action="store_true",
                   help="copy the target's files into --out (default: symbolic links)")
    p.add_argument("--workers", type=int, default=MTPRecipe.workers,
                   help="data parallel workers through Ray Train (one GPU each on CUDA); "
                        "--batch-size is per worker")
    p.add_argument("--address", default=None,
                   help="Ray cluster for --workers > 1 (default: the Ray this process "
                        "joined, else a local one)")


def job_of(args: argparse.Namespace, command: str):
    from chainspec.training.train_mtp import MTPJob

    schedule = StageSchedule(steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
                             weight_decay=0.0)
    recipe = MTPRecipe(args.num_mtp, schedule, args.seq_len, args.batch_size,
                       args.grad_accum, args.workers, args.held_out_percent,
                       args.continue_tokens, args.seed)
    e = EvalSettings(args.eval_windows, max(1, args.eval_windows // 4), args.eval_prompts,
                     args.eval_prompt_len, args.eval_new_tokens)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = device.startswith("cuda") if args.bf16 is None else args.bf16
    settings = RunSettings(e, args.log_every, args.checkpoint_every, device=device,
                           bf16=bf16, threads=args.threads, copy_target=args.copy_target,
                           address=args.address)
    return MTPJob(args.target, args.data, args.out, recipe, settings, args.resume, command)


def run(args: argparse.Namespace) -> int:
    """Checks every argument (`job_of`, then `train_mtp`'s `mtp_checks`) before it loads
    anything; a bad one is a ValueError: one line, exit 2."""
    import torch

    from chainspec.training.train_mtp import train_mtp

    job = job_of(args, "chainspec " + shlex.join(sys.argv[1:]))
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = train_mtp(job)
    finally:
        torch.set_num_threads(threads)
    print(f"wrote {args.out} in {report.seconds['total'] / 60:.1f} min; held-out mean "
          f"acceptance length {report.teacher_forced.mean_length:.2f} (teacher-forced), "
          f"{report.simulated.mean_length:.2f} (simulated)")
    return 0

"""What `chainspec train-mtp` trains and how: the recipe (everything a resumed run must
share with the run it continues) and the run settings (everything it may change)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from chainspec.training.recipe import EvalSettings, StageSchedule


@dataclass(frozen=True)
class MTPRecipe:
    # Defaults: the measured recipe (benchmarks/results/train_mtp/: demo target, 2.70).
    num_mtp: int = 3
    schedule: StageSchedule = StageSchedule(steps=1400, lr=3e-3, warmup_steps=40,
                                            weight_decay=0.0)
    seq_len: int = 512
    batch_size: int = 2  # sequences per batch (per worker)
    grad_accum: int = 1  # batches per optimizer step
    workers: int = 1  # data parallel ranks (Ray Train); the global batch is batch x workers
    held_out_percent: int = 5  # file/document-level held-out split (sha256 of its key)
    continue_tokens: int = 256  # tokens the target adds to each `prompt` record
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.num_mtp < 1 or self.seq_len <= self.num_mtp + 1:
            raise ValueError(f"need >= 1 MTP module and seq_len > num_mtp + 1, got "
                             f"num_mtp {self.num_mtp}, seq_len {self.seq_len}")
        if self.schedule.steps < 1:
            raise ValueError(f"steps must be >= 1 (0 would write untrained modules), "
                             f"got {self.schedule.steps}")
        if min(self.batch_size, self.grad_accum, self.workers, self.continue_tokens) < 1:
            raise ValueError(f"batch_size, grad_accum, workers and continue_tokens must be "
                             f">= 1, got {self.batch_size}, {self.grad_accum}, {self.workers} "
                             f"and {self.continue_tokens}")
        if not 0 < self.held_out_percent < 100:
            raise ValueError(f"held_out_percent must be in 1..99, got {self.held_out_percent}")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size * self.grad_accum * self.workers

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunSettings:
    """How this invocation runs; free to differ between a run and its resumption."""

    eval: EvalSettings = field(default_factory=EvalSettings)
    log_every: int = 50
    checkpoint_every: int = 200  # steps; 0 = no checkpoints
    keep_checkpoints: int = 2
    device: str = "cpu"
    bf16: bool = False  # autocast to bfloat16 (GPU); the target is then held in bf16
    threads: int = 2
    copy_target: bool = False  # copy the target's files into --out instead of linking
    address: str | None = None  # Ray cluster for workers > 1 (None: a local Ray)

    def __post_init__(self) -> None:
        if self.log_every < 1 or self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError(f"need log_every >= 1, checkpoint_every >= 0, keep_checkpoints "
                             f">= 1, got {self.log_every}, {self.checkpoint_every}, "
                             f"{self.keep_checkpoints}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

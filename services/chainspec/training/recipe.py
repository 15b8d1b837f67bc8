"""What the trainer builds and how: frozen dataclasses, one per concern, and two presets.

`DEMO` is the committed demo model (about 30 minutes on 2 idle CPU cores); `TINY` trains in
seconds for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from chainspec.models.config import ModelConfig, RopeConfig


@dataclass(frozen=True)
class ModelShape:
    """Target decoder shape; each of the `num_mtp` MTP blocks is one layer of it."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 14
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position: int = 512
    num_mtp: int = 3
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide into heads, heads into kv heads")
        if self.num_mtp < 1 or self.vocab_size < 300:
            raise ValueError("need >= 1 MTP module and a vocabulary above the 256 bytes")

    def model_config(self, eot_id: int) -> ModelConfig:
        return ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            max_position=self.max_position, rms_eps=self.rms_eps, tie_word_embeddings=True,
            rope=RopeConfig(theta=self.rope_theta), bos_token_id=eot_id,
            eos_token_ids=(eot_id,), num_mtp_layers=self.num_mtp, torch_dtype="bfloat16")


@dataclass(frozen=True)
class StageSchedule:
    """One optimisation stage: AdamW, linear warmup, cosine decay to `min_lr_ratio`."""

    steps: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.warmup_steps < 0:
            raise ValueError(f"steps and warmup_steps must be >= 0, got {self.steps} and "
                             f"{self.warmup_steps}")
        if not (0 < self.lr < math.inf):  # NOTE: NaN fails every comparison
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")


@dataclass(frozen=True)
class DataSettings:
    held_out_percent: int = 5
    max_file_bytes: int = 200_000
    max_files: int | None = None  # None = every stdlib file
    seq_len: int = 512
    batch_size: int = 4  # sequences per step

    def __post_init__(self) -> None:
        if not 0 < self.held_out_percent < 100:
            raise ValueError("held_out_percent must be in 1..99")


@dataclass(frozen=True)
class EvalSettings:
    windows: int = 64  # held-out windows of seq_len for the teacher-forced estimate
    loss_windows: int = 16  # held-out windows for the held-out loss rows
    prompts: int = 20  # self-speculation prompts
    prompt_len: int = 96
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if min(self.windows, self.loss_windows, self.prompts, self.max_new_tokens) < 1 \
                or self.prompt_len < 2:
            raise ValueError("evaluation windows, prompts and new tokens must be >= 1, the "
                             f"prompt length >= 2; got {self}")


@dataclass(frozen=True)
class Recipe:
    shape: ModelShape = field(default_factory=ModelShape)
    data: DataSettings = field(default_factory=DataSettings)
    joint: StageSchedule = StageSchedule(steps=1100, lr=3e-3, warmup_steps=50)
    distill: StageSchedule = StageSchedule(steps=500, lr=1.5e-3, warmup_steps=20,
                                           weight_decay=0.0)
    eval: EvalSettings = field(default_factory=EvalSettings)
    mtp_weight: float = 0.5  # lambda in L = CE_target + lambda * mean_k CE_mtp_k
    seed: int = 1234
    log_every: int = 100


DEMO = Recipe()

TINY = Recipe(
    shape=ModelShape(vocab_size=384, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, max_position=64),
    data=DataSettings(held_out_percent=30, max_files=12, seq_len=64, batch_size=2),
    joint=StageSchedule(steps=6, lr=3e-3, warmup_steps=2),
    distill=StageSchedule(steps=3, lr=1e-3, warmup_steps=1, weight_decay=0.0),
    eval=EvalSettings(windows=2, loss_windows=2, prompts=2, prompt_len=16,
                      max_new_tokens=12),
    log_every=3,
)

PRESETS = {"demo": DEMO, "tiny": TINY}


def with_steps(recipe: Recipe, joint: int | None, distill: int | None) -> Recipe:
    """The recipe with other stage lengths (command-line overrides)."""
    if joint is not None:
        recipe = replace(recipe, joint=replace(recipe.joint, steps=joint))
    if distill is not None:
        recipe = replace(recipe, distill=replace(recipe.distill, steps=distill))
    return recipe

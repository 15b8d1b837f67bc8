"""What a process that runs an engine needs to know: the model, the shapes it serves and
the engine options (`LocalOptions`), and where a verifier's MTP modules run
(`DrafterMode`).

Filled from a stack's config (`StackConfig.local_options(role)`), which the flag table
(`commands/stack_flags.py`) fills for every command; turned into engines only by
`engine/factory.py`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

import torch

from chainspec.engine.kv_budget import DEFAULT_BLOCK_SIZE, KVBudget

DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECULATIVE_DEPTHS = ("fixed", "adaptive")  # LocalOptions.speculative_depth


class DrafterMode(enum.StrEnum):
    """Where a verifier's MTP modules run."""

    REMOTE = "remote"  # drafter services reached over gRPC (scaled on their own)
    LOCAL = "local"  # in the verifier's own process, no wire (single-device deployments)


@dataclass(frozen=True)
class LocalOptions:
    model_dir: Path = DEMO_MODEL
    num_steps: int = 3
    chain: bool = True
    max_seqs: int = 8  # cap on running sequences
    max_len: int = 1024  # context limit of one sequence
    dtype: str = "float32"
    device: str = "cpu"
    # paged KV cache: bytes, or a share of free device memory (CUDA); neither: as much as
    # max_seqs fixed slots of max_len would take
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    # support of sampled draft distributions: the most a drafter serves, what a verifier
    # asks for (one value for both, so a verifier never asks for more than it gets)
    draft_top_k: int = 8
    use_graphs: bool = True  # CUDA graphs for both engines' steps on a GPU; False: eager
    # draft depth per round: "fixed" (K for every sequence) or "adaptive" (k in 0..K per
    # sequence each step, engine/adaptive_depth.py); a verifier's choice
    speculative_depth: str = "fixed"
    # this engine's ranks (engine/tp_group.py): the target's; in a drafter's options
    # (`for_drafter`'s caller) its MTP modules'. An in-process drafter runs at 1. 1: no group
    tensor_parallel_size: int = 1
    collective_timeout_s: float = 60.0  # a TP step whose peer is lost fails after this

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.draft_top_k < 1:
            raise ValueError(f"draft_top_k must be >= 1, got {self.draft_top_k}")
        if self.speculative_depth not in SPECULATIVE_DEPTHS:
            raise ValueError(f"speculative_depth must be one of {', '.join(SPECULATIVE_DEPTHS)}"
                             f", got {self.speculative_depth!r}")
        self.kv_budget  # noqa: B018  (validates the KV fields)

    @property
    def kv_budget(self) -> KVBudget:
        return KVBudget(self.kv_cache_memory, self.kv_cache_fraction, self.kv_block_size)

    def for_drafter(self, max_seqs: int | None = None) -> LocalOptions:
        """These options for a drafter serving verifiers built from them: `max_seqs` slots
        (default: as many as a verifier) and a KV pool of that many full sequences.

        NOTE: kv_cache_memory/kv_cache_fraction size a verifier's pool; a drafter beside
        it that took them too would claim the same bytes (or free memory) twice."""
        return dataclasses.replace(self, max_seqs=max_seqs or self.max_seqs,
                                   kv_cache_memory=None, kv_cache_fraction=None)

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
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chainspec.spine.sections import (
    DEMO_MODEL,
    DTYPE_NAMES,
    SPECULATIVE_DEPTHS,
    RoleSection,
    StackSection,
)
from chainspec.spine.sections import default as spine_default

if TYPE_CHECKING:
    from chainspec.engine.kv_budget import KVBudget

__all__ = ["DEMO_MODEL", "SPECULATIVE_DEPTHS", "DrafterMode", "LocalOptions"]  # and DTYPES
_s = functools.partial(spine_default, StackSection)
_r = functools.partial(spine_default, RoleSection)


def __getattr__(name: str) -> Any:
    """`DTYPES` (name -> torch dtype), imported on first use: torch loads only where an
    engine runs, never to build a command's parser."""
    if name == "DTYPES":
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}
    raise AttributeError(name)


def resolve_dtype(dtype: str, device: str, model_dir: Path) -> str:
    """`auto` (vLLM's default): the checkpoint's dtype on a GPU (config.json `torch_dtype`
    or `dtype`; bfloat16 when it says nothing readable), float32 on a CPU."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "bfloat16"
    named = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    return named if named in DTYPE_NAMES else "bfloat16"


class DrafterMode(enum.StrEnum):
    """Where a verifier's MTP modules run."""

    REMOTE = "remote"  # drafter services reached over gRPC (scaled on their own)
    LOCAL = "local"  # in the verifier's own process, no wire (single-device deployments)


@dataclass(frozen=True)
class LocalOptions:
    """One engine's options; every default is the spine's (`spine/sections.py`)."""

    model_dir: Path = DEMO_MODEL
    num_steps: int = _s("num_speculative_tokens")
    chain: bool = _s("chain")
    max_seqs: int = _s("max_num_seqs")  # cap on running sequences
    max_len: int = _s("max_model_len")  # context limit of one sequence
    dtype: str = _s("dtype")  # "auto" is resolved for `device` at construction
    device: str = "cpu"
    # paged KV cache: bytes, a share of free device memory (CUDA), or the member's share
    # of TOTAL device memory (vLLM's gpu_memory_utilization); none: as much as max_seqs
    # fixed slots of max_len would take
    kv_cache_memory: int | None = _s("kv_cache_memory_bytes")
    kv_cache_fraction: float | None = _s("kv_cache_fraction")
    gpu_memory_utilization: float | None = _s("gpu_memory_utilization")
    kv_block_size: int = _s("block_size")
    # support of sampled draft distributions: the most a drafter serves, what a verifier
    # asks for (one value for both, so a verifier never asks for more than it gets)
    draft_top_k: int = _s("draft_top_k")
    use_graphs: bool = not _s("enforce_eager")  # CUDA graphs on a GPU; False: eager
    # draft depth per round: "fixed" (K for every sequence) or "adaptive" (k in 0..K per
    # sequence each step, engine/adaptive_depth.py); a verifier's choice
    speculative_depth: str = _s("speculative_depth")
    seed: int | None = _s("seed")  # this process's draws for requests that set no seed
    enable_prefix_caching: bool = _s("enable_prefix_caching")  # share full prompt blocks
    state_snapshots: int | None = _s("state_snapshots")  # a hybrid's states at block ends
    # this engine's ranks (engine/tp_group.py): the target's; in a drafter's options
    # (`for_drafter`'s caller) its MTP modules'. An in-process drafter runs at 1. 1: no group
    tensor_parallel_size: int = _r("tensor_parallel_size")
    collective_timeout_s: float = _r("collective_timeout_s")  # a lost TP peer fails a step

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, "
                             f"got {self.dtype!r}")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device,
                                                        self.model_dir))
        if self.draft_top_k < 1:
            raise ValueError(f"draft_top_k must be >= 1, got {self.draft_top_k}")
        if self.speculative_depth not in SPECULATIVE_DEPTHS:
            raise ValueError(f"speculative_depth must be one of {', '.join(SPECULATIVE_DEPTHS)}"
                             f", got {self.speculative_depth!r}")
        if self.gpu_memory_utilization is not None and not self.device.startswith("cuda"):
            raise ValueError("gpu_memory_utilization is a share of a GPU's memory: a CPU "
                             "member takes kv_cache_memory_bytes (or its slots' need)")
        self.kv_budget  # noqa: B018  (validates the KV fields)

    @property
    def kv_budget(self) -> KVBudget:
        from chainspec.engine.kv_budget import KVBudget

        return KVBudget(self.kv_cache_memory, self.kv_cache_fraction, self.kv_block_size,
                        utilization=self.gpu_memory_utilization,
                        prefix_caching=self.enable_prefix_caching,
                        state_snapshots=self.state_snapshots)

    def for_drafter(self, max_seqs: int | None = None) -> LocalOptions:
        """These options for a drafter serving verifiers built from them: `max_seqs` slots
        (default: as many as a verifier) and a KV pool of that many full sequences.

        NOTE: the KV budget fields size a verifier's pool; a drafter beside it that took
        them too would claim the same bytes (or free memory) twice."""
        return dataclasses.replace(self, max_seqs=max_seqs or self.max_seqs,
                                   kv_cache_memory=None, kv_cache_fraction=None,
                                   gpu_memory_utilization=None)

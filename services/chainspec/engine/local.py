"""Build a verifier (and, for speculation, an in-process drafter) from a model directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.verifier import VerifierConfig, VerifierEngine
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel

DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LocalOptions:
    model_dir: Path = DEMO_MODEL
    num_steps: int = 3
    chain: bool = True
    max_seqs: int = 8
    max_len: int = 1024
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass
class LoadedModels:
    target: TargetModel
    draft: MTPDraftModel | None


def load_models(opts: LocalOptions, speculative: bool = True) -> LoadedModels:
    dtype = DTYPES[opts.dtype]
    target = load_target(opts.model_dir, dtype, opts.device, cache_len=opts.max_len)
    draft = load_draft_model(opts.model_dir, dtype, opts.device, cache_len=opts.max_len) \
        if speculative else None
    return LoadedModels(target, draft)


def build_verifier(models: LoadedModels, opts: LocalOptions, speculative: bool,
                   eos_ids=(), detokenize=None) -> VerifierEngine:
    """A verifier; with `speculative`, wired to an in-process drafter."""
    client = None
    if speculative:
        if models.draft is None:
            raise ValueError("speculative decoding needs the MTP draft model")
        drafter = DrafterEngine(models.draft, DrafterConfig(
            num_steps=opts.num_steps, chain=opts.chain, max_seqs=opts.max_seqs,
            max_len=opts.max_len))
        client = LocalDraftClient(drafter)
    config = VerifierConfig(num_steps=opts.num_steps, max_seqs=opts.max_seqs,
                            max_len=opts.max_len,
                            max_batch_tokens=max(1024, opts.max_seqs * (opts.num_steps + 1)))
    return VerifierEngine(models.target, config, client, eos_ids, detokenize)

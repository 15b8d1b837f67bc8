"""Build a verifier (and, for speculation, an in-process drafter) from a model directory.

One home for the pairing: `chainspec generate`/`bench` build the pair here, and so does a
verifier service whose drafter runs in its own process (`DrafterMode.LOCAL`)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.kv_budget import DEFAULT_BLOCK_SIZE, KVBudget
from chainspec.engine.verifier import VerifierConfig, VerifierEngine
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel

DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOCAL_DRAFTER = "in-process"  # the link name a local-mode verifier reports


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
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        self.kv_budget  # noqa: B018  (validates the KV fields)

    @property
    def kv_budget(self) -> KVBudget:
        return KVBudget(self.kv_cache_memory, self.kv_cache_fraction, self.block_size)


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


def verifier_config(opts: LocalOptions, groups: int = 1,
                    draft_ahead: bool = False) -> VerifierConfig:
    """The engine config of a verifier over `opts` (in process and as a service)."""
    return VerifierConfig(num_steps=opts.num_steps, max_seqs=opts.max_seqs,
                          max_len=opts.max_len, groups=groups, draft_ahead=draft_ahead,
                          kv=opts.kv_budget,
                          max_batch_tokens=max(1024, opts.max_seqs * (opts.num_steps + 1)))


def local_drafter(draft: MTPDraftModel, opts: LocalOptions, observer=None) -> LocalDrafts:
    """An in-process drafter for one verifier (as many slots as the verifier has)."""
    return LocalDrafts(DrafterEngine(draft, DrafterConfig(
        num_steps=opts.num_steps, chain=opts.chain, max_seqs=opts.max_seqs,
        max_len=opts.max_len), observer=observer))


def build_verifier(models: LoadedModels, opts: LocalOptions, speculative: bool,
                   eos_ids=(), detokenize=None, groups: int = 1) -> VerifierEngine:
    """A verifier; with `speculative`, wired to an in-process drafter."""
    client = None
    if speculative:
        if models.draft is None:
            raise ValueError("speculative decoding needs the MTP draft model")
        client = local_drafter(models.draft, opts)
    return VerifierEngine(models.target, verifier_config(opts, groups), client, eos_ids,
                          detokenize)


@dataclass
class LocalDraftStats:
    """What an in-process drafter did (cumulative; the remote pool's counterpart)."""

    rounds: int = 0  # update batches drafted
    draft_s_total: float = 0.0  # their compute time


class LocalDrafts(LocalDraftClient):
    """The in-process drafter of a verifier service in local mode: the draft client plus
    the read side the service shows for a drafter pool (one link, always live), so the
    hosting code treats both modes alike. It takes no drafter endpoints."""

    connect_timeout_s = 0.0

    def __init__(self, engine: DrafterEngine) -> None:
        super().__init__(engine)
        self.stats = LocalDraftStats()

    def submit(self, updates) -> None:
        t0 = time.perf_counter()
        super().submit(updates)
        self.stats.rounds += 1
        self.stats.draft_s_total += time.perf_counter() - t0

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        if tuple(endpoints):
            raise ValueError("this verifier drafts in process (drafter mode local); "
                             "it takes no drafter endpoints")

    def wait_connected(self, timeout: float | None = None) -> bool:
        return True

    def loads(self) -> dict[str, int]:
        return {LOCAL_DRAFTER: self.engine.load}

    def states(self) -> dict[str, str]:
        return {LOCAL_DRAFTER: "live"}

    def wanted(self) -> int:
        return 1

    def close(self) -> None:
        pass

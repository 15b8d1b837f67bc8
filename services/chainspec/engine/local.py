"""A verifier with its drafter in the same process, no wire (DESIGN 4.2, drafter mode
`local`): `chainspec generate`/`bench` build the pair here, and so does a verifier service
whose MTP modules run in its own process (`DrafterMode.LOCAL`). The engines themselves
come from `engine/factory.py`, as every engine does."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.drafter import DrafterEngine
from chainspec.engine.factory import (
    LoadedModels,
    build_drafter,
    build_verifier_engine,
    load_models,
    verifier_config,
)
from chainspec.engine.options import DEMO_MODEL, DTYPES, DrafterMode, LocalOptions
from chainspec.engine.verifier import VerifierEngine
from chainspec.models.mtp import MTPDraftModel

# NOTE: the options and loaders are re-exported: commands, benchmarks and tests take them
# from here (their homes are engine/options.py and engine/factory.py)
__all__ = ["DEMO_MODEL", "DTYPES", "LOCAL_DRAFTER", "DrafterMode", "LoadedModels",
           "LocalDraftStats", "LocalDrafts", "LocalOptions", "build_verifier", "load_models",
           "local_drafter", "verifier_config"]

LOCAL_DRAFTER = "in-process"  # the link name a local-mode verifier reports


def local_drafter(draft: MTPDraftModel, opts: LocalOptions, observer=None) -> LocalDrafts:
    """An in-process drafter for one verifier over `opts` (as many slots as it has)."""
    return LocalDrafts(build_drafter(draft, opts.for_drafter(), observer))


def build_verifier(models: LoadedModels, opts: LocalOptions, speculative: bool,
                   eos_ids=(), detokenize=None, groups: int = 1) -> VerifierEngine:
    """A verifier; with `speculative`, wired to an in-process drafter."""
    client = None
    if speculative:
        if models.draft is None:
            raise ValueError("speculative decoding needs the MTP draft model")
        client = local_drafter(models.draft, opts)
    return build_verifier_engine(models.target, opts, client, eos_ids, detokenize, groups)


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

"""The one place engines are built from `LocalOptions`.

Every engine that serves is made here: the in-process pair of `generate`/`bench` and of a
verifier in drafter mode local (`engine/local.py`), the Ray actors (`cluster/actors.py`)
and the single-service commands (`chainspec drafter`; `chainspec verifier` through
`rpc/verifier_service.py`). So an engine option (top-k, CUDA graphs, KV sizing) is read in
one place and reaches every engine alike. Draft clients are the caller's (a gRPC pool or
an in-process drafter): the verifier is built over whichever it is given.
"""

from __future__ import annotations

import atexit
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chainspec.engine.admission import SchedulingPolicy
from chainspec.engine.draft_client import DraftClient
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.observer import DrafterObserver
from chainspec.engine.options import DTYPES, LocalOptions
from chainspec.engine.verifier import VerifierConfig, VerifierEngine
from chainspec.models.loader import load_draft_model, load_target
from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel


@dataclass
class LoadedModels:
    target: TargetModel
    draft: MTPDraftModel | None


def load_target_model(opts: LocalOptions) -> TargetModel:
    """The target; with tensor_parallel_size N > 1, rank 0's `TPLeader` of a group whose
    other ranks run in processes of their own (closed at exit)."""
    if opts.tensor_parallel_size > 1:
        return start_group(opts).leader
    return load_target(opts.model_dir, DTYPES[opts.dtype], opts.device, cache_len=opts.max_len)


def start_group(opts: LocalOptions, draft: bool = False):
    """A group of `opts.tensor_parallel_size` ranks of the target (`draft`: of the MTP
    drafter), this process rank 0; closed at exit."""
    # NOTE: a stack member placed by the controller in a placement group of N bundles
    # hosts its ranks as Ray actors there (cluster/tp_ranks.py); else processes
    from chainspec.cluster.tp_ranks import start_in_own_group
    from chainspec.engine.tp_launch import ShardSource, start_local_group
    source = ShardSource(str(opts.model_dir), DTYPES[opts.dtype], opts.device,
                         opts.max_len, draft)
    group = start_in_own_group(source, opts.tensor_parallel_size,
                               opts.collective_timeout_s) or \
        start_local_group(opts.model_dir, opts.tensor_parallel_size,
                          DTYPES[opts.dtype], opts.device, opts.max_len,
                          collective_timeout_s=opts.collective_timeout_s, draft=draft)
    atexit.register(group.close)
    return group


def load_draft(opts: LocalOptions) -> MTPDraftModel:
    """The MTP modules only (embedding, LM head, modules; no target layers)."""
    return load_draft_model(opts.model_dir, DTYPES[opts.dtype], opts.device,
                            cache_len=opts.max_len)


def load_models(opts: LocalOptions, speculative: bool = True) -> LoadedModels:
    return LoadedModels(load_target_model(opts), load_draft(opts) if speculative else None)


def drafter_config(opts: LocalOptions) -> DrafterConfig:
    """The engine config of a drafter over `opts` (its slots and KV pool are `opts`')."""
    return DrafterConfig(num_steps=opts.num_steps, chain=opts.chain, max_seqs=opts.max_seqs,
                         max_len=opts.max_len, top_k=opts.draft_top_k,
                         use_graphs=opts.use_graphs, kv=opts.kv_budget)


def verifier_config(opts: LocalOptions, groups: int = 1, draft_ahead: bool = False,
                    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
                    ) -> VerifierConfig:
    """The engine config of a verifier over `opts` (in process and as a service)."""
    return VerifierConfig(num_steps=opts.num_steps, max_seqs=opts.max_seqs,
                          max_len=opts.max_len, groups=groups, draft_ahead=draft_ahead,
                          scheduling_policy=scheduling_policy,
                          draft_top_k=opts.draft_top_k, use_graphs=opts.use_graphs,
                          kv=opts.kv_budget,
                          adaptive_depth=opts.speculative_depth == "adaptive",
                          seed=opts.seed,
                          max_batch_tokens=max(1024, opts.max_seqs * (opts.num_steps + 1)))


class TimedDrafterEngine(DrafterEngine):
    """A DrafterEngine that counts its rounds and their compute time (benchmarks: the
    drafter's share of a round's draft wait; the rest is the wire)."""

    updates = 0
    update_s_total = 0.0

    def update(self, updates, rest_of=None):
        t0 = time.perf_counter()
        try:
            return super().update(updates, rest_of)
        finally:
            self.updates += 1
            self.update_s_total += time.perf_counter() - t0


def build_drafter(draft: MTPDraftModel, opts: LocalOptions,
                  observer: DrafterObserver | None = None) -> TimedDrafterEngine:
    """A drafter engine over loaded MTP modules (captures its CUDA graphs, if any)."""
    return TimedDrafterEngine(draft, drafter_config(opts), observer=observer)


def load_drafter(opts: LocalOptions,
                 observer: DrafterObserver | None = None) -> TimedDrafterEngine:
    """Load the MTP modules of `opts.model_dir` and build a drafter over them. With
    tensor_parallel_size N > 1 (a drafter's own: `StackConfig.local_options("drafter")`),
    over rank 0's `DraftLeader` of a group (`start_group`)."""
    if opts.tensor_parallel_size == 1:
        return build_drafter(load_draft(opts), opts, observer)
    leader = start_group(opts, draft=True).leader
    # NOTE: a TP drafter's steps are not captured in CUDA graphs (a TP verifier's are, on
    # NCCL: engine/tp_group.GraphPeers)
    return build_drafter(leader, dataclasses.replace(opts, use_graphs=False), observer)


def build_verifier_engine(target: TargetModel, opts: LocalOptions, drafts: DraftClient | None,
                          eos_ids: Sequence[int] = (),
                          detokenize: Callable[[list[int]], str] | None = None,
                          groups: int = 1, draft_ahead: bool = False,
                          scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
                          ) -> VerifierEngine:
    """A verifier engine over a loaded target and `drafts` (None: plain decoding)."""
    return VerifierEngine(target, verifier_config(opts, groups, draft_ahead, scheduling_policy),
                          drafts, eos_ids, detokenize)

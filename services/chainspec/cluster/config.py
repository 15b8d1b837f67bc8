"""Configuration of a Ray-hosted stack: the model, one `RoleConfig` per role, and how the
controller watches its members. Frozen, validated once, unknown keys rejected."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chainspec.cluster.autoscale import AutoscalePolicy
from chainspec.engine.admission import SchedulingPolicy
from chainspec.engine.options import DEMO_MODEL, DrafterMode, LocalOptions
from chainspec.rpc.channel import ClientOptions
from chainspec.rpc.server import ServerOptions
from chainspec.strict_config import build_strict, check_mapping

ROLES = ("drafter", "verifier")  # what the controller starts and scales
MEMBER_ROLES = (*ROLES, "gateway")  # gateways run outside and join
NAMESPACE = "chainspec"
CONTROLLER_NAME = "chainspec-controller"


@dataclass(frozen=True)
class RoleConfig:
    """How many actors of one role, and what each asks Ray for.

    `resource` is a custom Ray resource (default `chainspec_<role>`) requested in a tiny
    amount only when the cluster declares it, so that on a cluster with drafter and
    verifier node groups each role lands on its own nodes, while a plain local Ray
    (which declares none) still places everything.
    """

    replicas: int = 1
    num_gpus: float = 0.0  # > 0: the actor runs its model on "cuda"
    num_cpus: float = 0.0
    max_restarts: int = -1  # -1: Ray restarts a crashed actor forever
    resource: str = ""  # "" -> chainspec_<role>
    resource_amount: float = 0.001
    port: int = 0  # gRPC port of each actor; 0 = any free port. A fixed port allows one
    #                actor of the role per node (Kubernetes: one per pod, so probes work).
    metrics_port: int | None = 0  # Prometheus endpoint of each actor, like `port`; null: off
    tensor_parallel_size: int = 1  # ranks of one member (DESIGN 4.10; -tp)
    # a member's TP step whose peer rank is dead or hung fails after this (the member then
    # restarts as a group)
    collective_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535] or null, "
                             f"got {self.metrics_port}")
        if self.num_gpus < 0 or self.num_cpus < 0 or self.resource_amount <= 0:
            raise ValueError("num_gpus and num_cpus must be >= 0, resource_amount > 0")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= -1, got {self.max_restarts}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, "
                             f"got {self.tensor_parallel_size}")

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus > 0 else "cpu"


@dataclass(frozen=True)
class DrafterRoleConfig(RoleConfig):
    """The drafter role, and where drafting happens (`mode`):

    - `remote` (default): `replicas` drafter actors, reached by every verifier over gRPC;
    - `local`: each verifier runs the MTP modules in its own process, on its own device,
      with no wire (single-device deployments; the co-located baseline). No drafter
      actor exists, so `replicas` is 0 (its default in this mode) and the role's
      resources are unused.

    `autoscale` (remote mode only) lets the controller move the drafter count between the
    policy's bounds (`cluster/autoscale.py`); `replicas` is then the starting count (default:
    the minimum).
    """

    replicas: int | None = None  # type: ignore[assignment]  # None: 1 remote, 0 local
    mode: DrafterMode = DrafterMode.REMOTE
    autoscale: AutoscalePolicy | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", DrafterMode(self.mode))
        except ValueError:
            raise ValueError(f"drafter.mode must be one of "
                             f"{', '.join(m.value for m in DrafterMode)}, got {self.mode!r}"
                             ) from None
        if isinstance(self.autoscale, dict):
            object.__setattr__(self, "autoscale", AutoscalePolicy.from_dict(self.autoscale))
        policy = self.autoscale
        if policy is not None and self.local:
            raise ValueError("drafter.autoscale needs drafter.mode remote: in local mode "
                             "there are no drafter actors to scale")
        if self.replicas is None:
            default = policy.min_drafters if policy is not None else 0 if self.local else 1
            object.__setattr__(self, "replicas", default)
        if policy is not None and policy.clamp(self.replicas) != self.replicas:
            raise ValueError(f"drafter.replicas {self.replicas} is outside drafter.autoscale "
                             f"{policy.spec}")
        if self.local and self.replicas:
            raise ValueError(f"drafter.replicas must be 0 with drafter.mode local (each "
                             f"verifier drafts in process), got {self.replicas}")
        if self.local and self.tensor_parallel_size > 1:
            raise ValueError("drafter.tensor_parallel_size needs drafter.mode remote: in "
                             "local mode each verifier drafts in process at size 1")
        super().__post_init__()

    @property
    def local(self) -> bool:
        return self.mode is DrafterMode.LOCAL


@dataclass(frozen=True)
class StackConfig:
    model_dir: str = str(DEMO_MODEL)
    num_steps: int = 3  # K
    chain: bool = True
    max_seqs: int = 8  # sequence slots per verifier
    drafter_max_seqs: int = 64  # sequence slots per drafter (it serves every verifier)
    max_len: int = 1024
    dtype: str = "float32"
    kv_cache_memory: int | None = None  # each verifier's paged KV bytes (default: slots')
    kv_cache_fraction: float | None = None  # or a share of free device memory (CUDA)
    kv_block_size: int = LocalOptions.kv_block_size  # positions per KV block (every engine)
    draft_top_k: int = LocalOptions.draft_top_k  # support of sampled drafts (every engine)
    use_graphs: bool = LocalOptions.use_graphs  # CUDA graphs on GPU members; False: eager
    speculative_depth: str = LocalOptions.speculative_depth  # fixed K, or adaptive (4.11)
    drafter: DrafterRoleConfig = field(default_factory=DrafterRoleConfig)
    verifier: RoleConfig = field(default_factory=RoleConfig)
    host: str = "127.0.0.1"  # gRPC bind address; 0.0.0.0 advertises the node's IP
    namespace: str = NAMESPACE
    auth_token: str | None = None  # shared service-to-service token
    # mTLS between services (paths as seen inside every actor): servers present the
    # server pair and require client certificates signed by tls_ca; clients (verifiers
    # calling drafters) present the client pair and check servers against tls_ca.
    tls_ca: str | None = None
    tls_server_cert: str | None = None
    tls_server_key: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    # the name clients check server certificates against, instead of the host they dial:
    # members advertise pod/node IPs, which one shared certificate cannot list
    tls_server_name: str | None = None
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0  # a member that does not answer a ping in time is dead
    # a starting member cannot answer pings while it imports and loads; silent this long,
    # it is dead (hung, or re-adopted after a controller restart but gone quiet)
    start_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0  # longest wait for a draining member's load to reach 0
    draft_deadline_s: float = 0.05
    max_waiting: int = 64
    pipeline_groups: int = 1  # verifier groups taking turns (DESIGN 4.8); 1: off
    draft_ahead: bool = False  # verifiers use drafters' look-ahead drafts on a hit (4.8)
    # verifiers' admission order (engine/admission.py): fcfs, or priority (lower first)
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    controller_metrics_port: int | None = 0  # the controller's /metrics (autoscaler); null: off

    def __post_init__(self) -> None:
        self.local_options("verifier")  # validates the model and KV fields
        try:
            object.__setattr__(self, "scheduling_policy",
                               SchedulingPolicy(self.scheduling_policy))
        except ValueError:
            raise ValueError(f"scheduling_policy must be one of "
                             f"{', '.join(p.value for p in SchedulingPolicy)}, "
                             f"got {self.scheduling_policy!r}") from None
        if min(self.num_steps, self.max_seqs, self.drafter_max_seqs,
               self.pipeline_groups) < 1 or self.max_len < 2 * self.num_steps + 2:
            raise ValueError("num_steps, max_seqs, drafter_max_seqs and pipeline_groups "
                             "must be >= 1, max_len > 2K + 1")
        if not isinstance(self.drafter, DrafterRoleConfig):  # a plain RoleConfig: remote
            object.__setattr__(self, "drafter", DrafterRoleConfig(
                **dataclasses.asdict(self.drafter)))
        if min(self.health_interval_s, self.health_timeout_s, self.drain_timeout_s,
               self.draft_deadline_s, self.start_timeout_s) <= 0:
            raise ValueError("health, drain and draft timings must be > 0")
        if self.controller_metrics_port is not None \
                and not 0 <= self.controller_metrics_port < 65536:
            raise ValueError(f"controller_metrics_port must be in [0, 65535] or null, "
                             f"got {self.controller_metrics_port}")
        if not self.namespace or not self.host:
            raise ValueError("namespace and host must not be empty")
        tls = (self.tls_ca, self.tls_server_cert, self.tls_server_key, self.tls_client_cert,
               self.tls_client_key)
        if any(tls) and not all(tls):
            raise ValueError("mTLS needs all of tls_ca, tls_server_cert, tls_server_key, "
                             "tls_client_cert and tls_client_key (or none of them)")

    def server_options(self, role: str, drain_grace_s: float) -> ServerOptions:
        """How an actor of `role` serves gRPC."""
        return ServerOptions(host=self.host, port=self.role(role).port,
                             metrics_port=self.role(role).metrics_port,
                             auth_token=self.auth_token, drain_grace_s=drain_grace_s,
                             tls_cert=_path(self.tls_server_cert),
                             tls_key=_path(self.tls_server_key),
                             tls_client_ca=_path(self.tls_ca))

    def client_options(self) -> ClientOptions:
        """How services call each other (verifier -> drafter, gateway -> verifier)."""
        return ClientOptions(auth_token=self.auth_token, tls_ca=_path(self.tls_ca),
                             tls_cert=_path(self.tls_client_cert),
                             tls_key=_path(self.tls_client_key),
                             tls_server_name=self.tls_server_name)

    def role(self, role: str) -> RoleConfig:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
        return self.drafter if role == "drafter" else self.verifier

    def resource_name(self, role: str) -> str:
        return self.role(role).resource or f"chainspec_{role}"

    def local_options(self, role: str) -> LocalOptions:
        """The engine options of a `role` member (`engine/factory.py` builds from them): a
        drafter has drafter_max_seqs slots and a KV pool sized by them."""
        opts = LocalOptions(
            model_dir=Path(self.model_dir), num_steps=self.num_steps, chain=self.chain,
            max_seqs=self.max_seqs, max_len=self.max_len, dtype=self.dtype,
            device=self.role(role).device, kv_cache_memory=self.kv_cache_memory,
            kv_cache_fraction=self.kv_cache_fraction, kv_block_size=self.kv_block_size,
            draft_top_k=self.draft_top_k, use_graphs=self.use_graphs,
            speculative_depth=self.speculative_depth,
            tensor_parallel_size=self.role(role).tensor_parallel_size,
            collective_timeout_s=self.role(role).collective_timeout_s)
        return opts.for_drafter(self.drafter_max_seqs) if role == "drafter" else opts

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["drafter"]["mode"] = str(self.drafter.mode)  # plain JSON/YAML
        out["scheduling_policy"] = str(self.scheduling_policy)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StackConfig:
        """From parsed JSON/YAML; unknown keys are an error naming them."""
        check_mapping(data, "config", cls=cls)  # NOTE: before dict(), which takes lists
        data = dict(data)
        for role, role_cls in (("drafter", DrafterRoleConfig), ("verifier", RoleConfig)):
            if role in data:
                data[role] = build_strict(role_cls, data[role], role)
        return build_strict(cls, data, "config")


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None

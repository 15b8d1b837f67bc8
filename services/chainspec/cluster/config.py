"""Configuration of a Ray-hosted stack: the model, one `RoleConfig` per role, and how the
controller watches its members. Frozen, validated once, unknown keys rejected."""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chainspec.cluster.autoscale import AutoscalePolicy
from chainspec.engine.options import DrafterMode
from chainspec.spine import RoleSection, StackSection, file_form, runtime_fields, validate
from chainspec.spine.read import ConfigError, speculative
from chainspec.spine.sections import DrafterRoleSection
from chainspec.spine.sections import default as spine_default

if TYPE_CHECKING:  # NOTE: grpc and torch load where used, not to build a parser
    from chainspec.engine.admission import SchedulingPolicy
    from chainspec.engine.options import LocalOptions
    from chainspec.rpc.channel import ClientOptions
    from chainspec.rpc.server import ServerOptions

_s = functools.partial(spine_default, StackSection)  # the one default of a stack key
ROLES = ("drafter", "verifier")  # what the controller starts and scales
MEMBER_ROLES = (*ROLES, "gateway")  # gateways run outside and join
NAMESPACE = StackSection.model_fields["namespace"].default
CONTROLLER_NAME = "chainspec-controller"


@dataclass(frozen=True)
class RoleConfig:
    """How many actors of one role, and what each asks Ray for.

    `resource` is a custom Ray resource (default `chainspec_<role>`) requested in a tiny
    amount only when the cluster declares it, so that on a cluster with drafter and
    verifier node groups each role lands on its own nodes, while a plain local Ray
    (which declares none) still places everything.
    """

    replicas: int = spine_default(RoleSection, "replicas")
    num_gpus: float = spine_default(RoleSection, "num_gpus")  # > 0: the model runs on cuda
    num_cpus: float = spine_default(RoleSection, "num_cpus")
    max_restarts: int = spine_default(RoleSection, "max_restarts")  # -1: forever
    resource: str = spine_default(RoleSection, "resource")  # "" -> chainspec_<role>
    resource_amount: float = spine_default(RoleSection, "resource_amount")
    # gRPC port of each actor; 0 = any free port. A fixed port allows one actor of the
    # role per node (Kubernetes: one per pod, so probes work).
    port: int = spine_default(RoleSection, "port")
    metrics_port: int | None = spine_default(RoleSection, "metrics_port")  # like port; null: off
    tensor_parallel_size: int = spine_default(RoleSection, "tensor_parallel_size")  # 4.10
    # a member's TP step whose peer rank is dead or hung fails after this (the member then
    # restarts as a group)
    collective_timeout_s: float = spine_default(RoleSection, "collective_timeout_s")

    def __post_init__(self) -> None:
        _check(RoleSection, self, "config: role")  # types and bounds: the spine's

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

    replicas: int | None = spine_default(DrafterRoleSection, "replicas")  # type: ignore[assignment]  # noqa: E501
    mode: DrafterMode = DrafterMode(spine_default(DrafterRoleSection, "mode"))
    autoscale: AutoscalePolicy | None = None

    def __post_init__(self) -> None:
        _check(DrafterRoleSection, self, "config: drafter")  # types and bounds: the spine's
        object.__setattr__(self, "mode", DrafterMode(self.mode))
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

    @property
    def local(self) -> bool:
        return self.mode is DrafterMode.LOCAL


@dataclass(frozen=True)
class StackConfig:
    """The stack's runtime form, built from the spine (`spine/sections.py` StackSection:
    every key's type, default, bounds and help; comments here say only how it is used).
    Field names are the engine's; the file/flag names are the spine's (max_seqs is
    max_num_seqs, max_len max_model_len, ...)."""

    model_dir: str = _s("model")  # a directory, or a Hub id (commands/hub_args.py)
    revision: str | None = _s("revision")  # of a Hub id
    download_dir: str | None = _s("download_dir")  # the Hugging Face cache for Hub ids
    num_steps: int = _s("num_speculative_tokens")  # K
    chain: bool = _s("chain")
    max_seqs: int = _s("max_num_seqs")  # sequence slots per verifier
    drafter_max_seqs: int = _s("drafter_max_num_seqs")  # per drafter (serves every verifier)
    max_len: int = _s("max_model_len")
    dtype: str = _s("dtype")  # "auto": resolved per member by LocalOptions (its device)
    kv_cache_memory: int | None = _s("kv_cache_memory_bytes")  # each verifier's KV bytes
    kv_cache_fraction: float | None = _s("kv_cache_fraction")  # share of free device memory
    gpu_memory_utilization: float | None = _s("gpu_memory_utilization")  # share of total
    kv_block_size: int = _s("block_size")  # positions per KV block (every engine)
    draft_top_k: int = _s("draft_top_k")  # support of sampled drafts (every engine)
    use_graphs: bool = not _s("enforce_eager")  # CUDA graphs on GPU members; False: eager
    speculative_depth: str = _s("speculative_depth")  # fixed K, or adaptive (4.11)
    seed: int | None = _s("seed")  # members' draws for unseeded requests
    enable_prefix_caching: bool = _s("enable_prefix_caching")  # verifiers share prefixes
    state_snapshots: int | None = _s("state_snapshots")  # a hybrid verifier's, at block ends
    drafter: DrafterRoleConfig = field(default_factory=DrafterRoleConfig)
    verifier: RoleConfig = field(default_factory=RoleConfig)
    host: str = _s("grpc_host")  # gRPC bind address; 0.0.0.0 advertises the node's IP
    namespace: str = _s("namespace")
    auth_token: str | None = _s("auth_token")  # shared service-to-service token
    # mTLS between services (paths as seen inside every actor): servers present the
    # server pair and require client certificates signed by tls_ca; clients (verifiers
    # calling drafters) present the client pair and check servers against tls_ca.
    tls_ca: str | None = _s("tls_ca")
    tls_server_cert: str | None = _s("tls_server_cert")
    tls_server_key: str | None = _s("tls_server_key")
    tls_client_cert: str | None = _s("tls_client_cert")
    tls_client_key: str | None = _s("tls_client_key")
    # the name clients check server certificates against, instead of the host they dial:
    # members advertise pod/node IPs, which one shared certificate cannot list
    tls_server_name: str | None = _s("tls_server_name")
    health_interval_s: float = _s("health_interval_s")
    health_timeout_s: float = _s("health_timeout_s")  # silent to a ping this long: dead
    # a starting member cannot answer pings while it imports and loads; silent this long,
    # it is dead (hung, or re-adopted after a controller restart but gone quiet)
    start_timeout_s: float = _s("start_timeout_s")
    drain_timeout_s: float = _s("drain_timeout_s")  # longest wait for a draining member
    draft_deadline_s: float = _s("draft_deadline_s")
    max_waiting: int = _s("max_waiting")
    pipeline_groups: int = _s("pipeline_groups")  # verifier groups taking turns (4.8)
    draft_ahead: bool = _s("draft_ahead")  # look-ahead drafts used on a hit (4.8)
    # verifiers' admission order (engine/admission.py): fcfs, or priority (lower first)
    scheduling_policy: SchedulingPolicy = _s("scheduling_policy")
    controller_metrics_port: int | None = _s("controller_metrics_port")  # null: off

    def __post_init__(self) -> None:
        from chainspec.engine.admission import SchedulingPolicy

        if not isinstance(self.drafter, DrafterRoleConfig):  # a plain RoleConfig: remote
            object.__setattr__(self, "drafter", DrafterRoleConfig(
                **dataclasses.asdict(self.drafter)))
        _check(StackSection, self, "config")  # types and bounds: the spine's
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        self.local_options("verifier")  # validates the model and KV fields
        if self.max_len < 2 * self.num_steps + 2:
            raise ValueError(f"max_model_len {self.max_len} must exceed 2K + 1 = "
                             f"{2 * self.num_steps + 1} (num_speculative_tokens K = "
                             f"{self.num_steps})")
        tls = (self.tls_ca, self.tls_server_cert, self.tls_server_key, self.tls_client_cert,
               self.tls_client_key)
        if any(tls) and not all(tls):
            raise ValueError("mTLS needs all of tls_ca, tls_server_cert, tls_server_key, "
                             "tls_client_cert and tls_client_key (or none of them)")

    def server_options(self, role: str, drain_grace_s: float) -> ServerOptions:
        """How an actor of `role` serves gRPC."""
        from chainspec.rpc.server import ServerOptions

        return ServerOptions(host=self.host, port=self.role(role).port,
                             metrics_port=self.role(role).metrics_port,
                             auth_token=self.auth_token, drain_grace_s=drain_grace_s,
                             tls_cert=_path(self.tls_server_cert),
                             tls_key=_path(self.tls_server_key),
                             tls_client_ca=_path(self.tls_ca))

    def client_options(self) -> ClientOptions:
        """How services call each other (verifier -> drafter, gateway -> verifier)."""
        from chainspec.rpc.channel import ClientOptions

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
        """The engine options of a `role` member (`engine/factory.py` builds from them):
        every LocalOptions field of the same name here (so a new engine option needs no
        line in this method), the role's device and ranks; a drafter has
        drafter_max_seqs slots and a KV pool sized by them."""
        from chainspec.engine.options import LocalOptions

        member = self.role(role)
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(LocalOptions)
                  if hasattr(self, f.name)}
        opts = LocalOptions(**{
            **shared, "model_dir": Path(self.model_dir), "device": member.device,
            "tensor_parallel_size": member.tensor_parallel_size,
            "collective_timeout_s": member.collective_timeout_s,
            # NOTE: a verifier's share of its GPU; a drafter beside it must not claim it
            "gpu_memory_utilization": None if role == "drafter"
            else self.gpu_memory_utilization})
        return opts.for_drafter(self.drafter_max_seqs) if role == "drafter" else opts

    def to_dict(self) -> dict[str, Any]:
        """The file form (the spine's keys: `from_dict` reads it back without warnings)."""
        return file_form(StackSection, _plain(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: Any, where: str = "config",
                  flags: dict[str, str] | None = None) -> StackConfig:
        """From parsed JSON/YAML (the spine's keys; old names warn): every problem one
        ValueError line naming the key and `where` (or the flag in `flags` that set it)."""
        if isinstance(data, dict):
            data = speculative(data, where, flags)
        return of_section(validate(StackSection, data, where, flags), where)


def of_section(section: StackSection, where: str) -> StackConfig:
    """The runtime form of a validated section; cross-key checks name `where`."""
    fields = runtime_fields(section)
    del fields["speculative_config"]
    drafter, verifier = fields.pop("drafter"), fields.pop("verifier")
    try:
        return StackConfig(drafter=DrafterRoleConfig(**drafter),
                           verifier=RoleConfig(**verifier), **fields)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _check(section, obj, where: str) -> None:
    """A runtime config's types and bounds, by the spine (also when built directly)."""
    validate(section, file_form(section, _plain(dataclasses.asdict(obj))), where)


def _plain(value: Any) -> Any:
    """Enums as their values, Paths as strings, tuples as lists (the file form)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return str(value) if isinstance(value, Path) else value


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None

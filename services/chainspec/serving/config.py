"""The `chainspec serve` configuration: the stack, the gateway and where Ray is.

A YAML (or JSON) file holds `StackConfig`'s keys at the top level (the same keys as
`chainspec up --config`), plus `address`, `start_timeout_s` and a `gateway:` section
(`GatewayConfig`'s keys). Every level is a frozen dataclass validated once; an unknown
key is an error that names it. Command-line flags override the file (the file reader
and the flags are `commands/stack_flags.py`'s, shared with `chainspec up`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chainspec.cluster.config import StackConfig, of_section
from chainspec.gateway.config import GatewayConfig
from chainspec.spine import ServeSection, StackSection, runtime_fields, validate
from chainspec.spine.read import speculative
from chainspec.spine.sections import default as spine_default

# beside the stack's keys; start_timeout_s here is serve's wait for the whole stack
SERVE_KEYS = ("address", "start_timeout_s", "gateway")
SECRETS = ("auth_token", "api_key")


@dataclass(frozen=True)
class ServeConfig:
    stack: StackConfig = field(default_factory=StackConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    address: str | None = spine_default(ServeSection, "address")  # None: a local Ray
    # longest wait for the stack to load and warm up (the stack's default, read here)
    start_timeout_s: float = spine_default(ServeSection, "start_timeout_s")

    def __post_init__(self) -> None:
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")
        if self.address is not None and not self.address.strip():
            raise ValueError("address must not be empty (leave it unset for a local Ray)")

    @classmethod
    def from_dict(cls, data: Any, where: str = "config",
                  flags: Mapping[str, str] | None = None) -> ServeConfig:
        """From parsed YAML/JSON (the spine's keys; old names warn): every problem one
        ValueError line naming the key and `where` (or the flag that set it)."""
        if isinstance(data, dict):
            data = speculative(data, where, flags)
        section = validate(ServeSection, data, where, flags)
        given = section.model_fields_set - set(SERVE_KEYS)
        stack = StackSection.model_construct(  # NOTE: every value validated just above
            _fields_set=given, **{k: getattr(section, k) for k in given})
        return cls(of_section(stack, where),
                   GatewayConfig(**runtime_fields(section.gateway)), section.address,
                   section.start_timeout_s)

    def to_dict(self) -> dict[str, Any]:
        """The file form: stack keys at the top level, the gateway in its section."""
        return {**self.stack.to_dict(), "address": self.address,
                "start_timeout_s": self.start_timeout_s, "gateway": self.gateway.to_dict()}

    def describe(self) -> dict[str, Any]:
        """`to_dict` with secrets masked, for printing."""
        return mask_secrets(self.to_dict())


def mask_secrets(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ("<set>" if k in SECRETS and v else mask_secrets(v)) for k, v in value.items()}
    return value

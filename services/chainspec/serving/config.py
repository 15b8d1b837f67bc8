"""The `chainspec serve` configuration: the stack, the gateway and where Ray is.

A YAML (or JSON) file holds `StackConfig`'s keys at the top level (the same keys as
`chainspec up --config`), plus `address`, `start_timeout_s` and a `gateway:` section
(`GatewayConfig`'s keys). Every level is a frozen dataclass validated once; an unknown
key is an error that names it. Command-line flags override the file (the file reader
and the flags are `commands/stack_flags.py`'s, shared with `chainspec up`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chainspec.cluster.config import StackConfig
from chainspec.gateway.config import GatewayConfig
from chainspec.strict_config import check_mapping

SERVE_KEYS = ("address", "start_timeout_s", "gateway")
SECRETS = ("auth_token", "api_key")


@dataclass(frozen=True)
class ServeConfig:
    stack: StackConfig = field(default_factory=StackConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    address: str | None = None  # Ray cluster to join; None: an embedded local Ray
    start_timeout_s: float = 300.0  # longest wait for the stack to load and warm up

    def __post_init__(self) -> None:
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")
        if self.address is not None and not self.address.strip():
            raise ValueError("address must not be empty (leave it unset for a local Ray)")

    @classmethod
    def from_dict(cls, data: Any) -> ServeConfig:
        check_mapping(data, "config", SERVE_KEYS, cls=StackConfig)
        stack = {k: v for k, v in data.items() if k not in SERVE_KEYS}
        return cls(StackConfig.from_dict(stack), GatewayConfig.from_dict(data.get("gateway", {})),
                   data.get("address"), data.get("start_timeout_s", cls.start_timeout_s))

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

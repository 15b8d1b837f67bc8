"""How the gateway listens and admits requests: one frozen dataclass, validated once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from chainspec.strict_config import build_strict

MAX_N_LIMIT = 256  # the most choices --max-n may allow (each is a verifier request)


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP side of the gateway. `api_key` set: every /v1 call must carry
    `Authorization: Bearer <api_key>` (/health and /metrics stay open for probes)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: an ephemeral port
    api_key: str | None = None
    model_name: str = ""  # the name clients use; "" = the name the verifiers report
    max_in_flight: int = 256  # requests in flight through this gateway, then 429
    retry_after_s: int = 1  # Retry-After of 429 and 503 answers
    request_timeout_s: float = 600.0  # deadline of one request at the verifier
    refresh_interval_s: float = 1.0  # how often verifiers' health and load are polled
    max_body_bytes: int = 8 * 2 ** 20  # a larger request body is 413, refused unread
    max_n: int = 16  # choices (`n`) one request may ask for; more is a 400 naming n
    trust_request_chat_template: bool = False  # honour a request's chat_template (vLLM)
    chat_template: str | None = None  # --chat-template: a file or the text (the model's)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("gateway.host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"gateway.port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("gateway.api_key must not be empty (leave it unset to disable)")
        if self.max_in_flight < 1:
            raise ValueError(f"gateway.max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.retry_after_s < 0:
            raise ValueError(f"gateway.retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"gateway.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.request_timeout_s <= 0 or self.refresh_interval_s <= 0:
            raise ValueError("gateway.request_timeout_s and refresh_interval_s must be > 0")
        if not 1 <= self.max_n <= MAX_N_LIMIT:
            raise ValueError(f"gateway.max_n must be in [1, {MAX_N_LIMIT}], got {self.max_n}")
        if not isinstance(self.trust_request_chat_template, bool):
            raise ValueError(f"gateway.trust_request_chat_template must be true or false, "
                             f"got {self.trust_request_chat_template!r}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str)
                                               or not self.chat_template.strip()):
            raise ValueError(f"gateway.chat_template must be a file or a template, got "
                             f"{self.chat_template!r}")

    @classmethod
    def from_dict(cls, data: Any) -> GatewayConfig:
        """From parsed YAML/JSON; unknown keys are an error naming them."""
        return build_strict(cls, data, "gateway")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

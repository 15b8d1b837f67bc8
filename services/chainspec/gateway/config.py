"""How the gateway listens and admits requests: one frozen dataclass, validated once."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from chainspec.spine import GatewaySection, file_form, runtime_fields, validate
from chainspec.spine.sections import default as spine_default

MAX_N_LIMIT = GatewaySection.model_fields["max_n"].metadata[-1].le  # the spine's bound
_g = functools.partial(spine_default, GatewaySection)  # the one default of a gateway key


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP side of the gateway, built from the spine (`spine/sections.py`
    GatewaySection: types, defaults, bounds, help). `api_key` set: every /v1 call must
    carry `Authorization: Bearer <api_key>` (/health and /metrics stay open for probes)."""

    host: str = _g("host")
    port: int = _g("port")  # 0: an ephemeral port
    api_key: str | None = _g("api_key")
    # the names clients use (each in /v1/models, each accepted as `model`); () = the
    # name the verifiers report
    served_model_name: tuple[str, ...] = tuple(_g("served_model_name"))
    max_in_flight: int = _g("max_in_flight")  # requests in flight, then 429
    retry_after_s: int = _g("retry_after_s")  # Retry-After of 429 and 503 answers
    request_timeout_s: float = _g("request_timeout_s")  # deadline at the verifier
    refresh_interval_s: float = _g("refresh_interval_s")  # verifiers' health/load polls
    max_body_bytes: int = _g("max_body_bytes")  # a larger body is 413, refused unread
    max_n: int = _g("max_n")  # choices (`n`) one request may ask for; more is a 400
    trust_request_chat_template: bool = _g("trust_request_chat_template")  # (vLLM)
    chat_template: str | None = _g("chat_template")  # --chat-template: file or text
    generation_config: str = _g("generation_config")  # auto | vllm | DIR
    max_logprobs: int = _g("max_logprobs")  # a larger logprobs/top_logprobs is a 400
    # what `generation_config` resolved to (gateway/generation_config.py), set at start:
    # (request field, default) pairs for requests that leave the field unset
    sampling_defaults: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # one name ("": none)
            object.__setattr__(self, "served_model_name",
                               (self.served_model_name,) if self.served_model_name else ())
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        validate(GatewaySection, file_form(GatewaySection, dataclasses.asdict(self)),
                 "gateway")

    @property
    def model_name(self) -> str:
        """The first served name ("" = the verifiers'): metrics' `model_name` label."""
        return self.served_model_name[0] if self.served_model_name else ""

    @classmethod
    def from_dict(cls, data: Any, where: str = "gateway",
                  flags: dict[str, str] | None = None) -> GatewayConfig:
        """From parsed YAML/JSON (the spine's keys; old names warn); every problem one
        ValueError line naming the key and `where` (or the flag in `flags` that set it)."""
        return cls(**runtime_fields(validate(GatewaySection, data, where, flags)))

    def to_dict(self) -> dict[str, Any]:
        return file_form(GatewaySection, dataclasses.asdict(self))

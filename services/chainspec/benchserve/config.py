"""What one `bench serve` run measures: the load points, the dataset, the SLOs."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class LoadKind(enum.Enum):
    CONCURRENCY = "concurrency"  # a fixed number of requests in flight (closed loop)
    RATE = "rate"  # open-loop Poisson arrivals at `value` requests per second


@dataclass(frozen=True)
class LoadPoint:
    kind: LoadKind
    value: float

    def __post_init__(self) -> None:
        if not (self.value > 0 and math.isfinite(self.value)):
            raise ValueError(f"a {self.kind.value} load point must be > 0, got {self.value}")
        if self.kind is LoadKind.CONCURRENCY and self.value != int(self.value):
            raise ValueError(f"concurrency must be an integer, got {self.value}")

    @property
    def label(self) -> str:
        if self.kind is LoadKind.CONCURRENCY:
            return f"c={int(self.value)}"
        return f"{self.value:g} req/s"


@dataclass(frozen=True)
class SLO:
    """Goodput counts completed requests within every limit given (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a number > 0, got {value}")

    @classmethod
    def parse(cls, items: list[str]) -> SLO:
        """`["ttft:500", "tpot:50"]` (ms) -> SLO; unknown metrics are rejected."""
        limits: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            try:
                if not sep or name not in ("ttft", "tpot", "e2e"):
                    raise ValueError
                limits[f"{name}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or "
                                 "e2e:MS") from None
        return cls(**limits)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms),
                                  ("e2e_ms", self.e2e_ms)) if v is not None}


@dataclass(frozen=True)
class SweepConfig:
    base_url: str
    points: tuple[LoadPoint, ...]
    requests_per_point: int
    model: str | None = None  # None: the first of /v1/models
    api_key: str | None = None
    slo: SLO = field(default_factory=SLO)
    seed: int = 0
    timeout_s: float = 300.0  # one request, connect to last byte
    warmup_requests: int = 1  # per sweep, not counted
    idle_tail_s: float = 0.0  # drafters sampled this long after the last point (scale-in)

    def __post_init__(self) -> None:
        check_base_url(self.base_url)
        if not self.points:
            raise ValueError("give at least one load point (--concurrency or --request-rate)")
        if self.requests_per_point < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.requests_per_point}")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup_requests}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"--timeout must be a number of seconds > 0, got {self.timeout_s}")
        if not (self.idle_tail_s >= 0 and math.isfinite(self.idle_tail_s)):
            raise ValueError(f"--idle-tail must be a number of seconds >= 0, "
                             f"got {self.idle_tail_s}")


def check_base_url(url: str) -> None:
    """`http(s)://host[:port][/prefix]`, without `/v1` (the client adds it)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises for a port that is not a number)
    except ValueError as e:
        raise ValueError(f"--base-url {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    if parts.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"--base-url {url!r}: leave out /v1 (requests go to /v1/...)")

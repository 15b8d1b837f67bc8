"""What every chainspec process exports: its own registry and a build/config info metric."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Info
from prometheus_client.exposition import generate_latest

from chainspec.rpc.call_metrics import CallMetrics
from chainspec.version import chainspec_version

PREFIX = "chainspec_"


class ServiceMetrics:
    """A process's registry (never the global one) and `chainspec_build_info`, whose
    labels say what this process serves: version, model, K, dtype, chain mode."""

    def __init__(self, model: str = "") -> None:
        self.model = model  # the `model_name` label of this process's metrics
        self.registry = CollectorRegistry(auto_describe=True)
        self._info = Info("chainspec_build", "What this process runs (value 1)",
                          registry=self.registry)
        self.set_info()

    def set_info(self, num_steps: int | None = None, dtype: str = "",
                 chain: bool | None = None) -> None:
        self._info.info({"version": chainspec_version(), "model_name": self.model,
                         "num_steps": "" if num_steps is None else str(num_steps),
                         "dtype": dtype, "chain": "" if chain is None else str(chain).lower()})

    def names(self) -> set[str]:
        """Every sample name this registry can export (`_total`, `_bucket`, ... included),
        also for labelled metrics that have no sample yet."""
        return {name for family in self.registry.collect() for name in _suffixed(family)}

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class GrpcServiceMetrics(ServiceMetrics):
    """A gRPC service's process: also its server's call metrics (`rpc/call_metrics.py`)."""

    def __init__(self, model: str = "") -> None:
        super().__init__(model)
        self.calls = CallMetrics(self.registry)


def _suffixed(family) -> list[str]:
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum",
                                                                  "_created"),
                "info": ("_info",), "gauge": ("",), "summary": ("_count", "_sum", "_created")}
    return [family.name + s for s in suffixes.get(family.type, ("",))]

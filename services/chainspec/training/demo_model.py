"""The demo model: a fresh Llama target plus K MTP modules, trained from scratch."""

from __future__ import annotations

from chainspec.models.config import ModelConfig
from chainspec.models.target import TargetModel
from chainspec.training.mtp_model import TargetWithMTP, init_normal


class DemoModel(TargetWithMTP):
    def __init__(self, cfg: ModelConfig, num_mtp: int) -> None:
        super().__init__(TargetModel(cfg), num_mtp)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Every parameter, target and modules, from one seeded generator."""
        init_normal(self, seed, std, self.config.num_layers + self.num_mtp)

"""Model configuration parsed from a Hugging Face `config.json`.

One frozen dataclass for the decoder's shape, shared by the target and its MTP modules;
a family (`models/families/`) parses its own config into it, or into a frozen subclass
with the family's extra fields. Unknown architectures are rejected once, by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chainspec.models.errors import CheckpointError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise CheckpointError(f"unsupported rope_scaling type {self.type!r}; "
                                  f"supported: {', '.join(ROPE_TYPES)}")
        if self.factor <= 0:
            raise CheckpointError(f"rope_scaling factor must be > 0, got {self.factor}")

    def position_limit(self, max_position: int) -> int:
        """Positions the model takes given its `max_position_embeddings`: that, unless the
        scaling extends it -- linear and dynamic by `factor`, yarn its original length
        (else `max_position`) by `factor`. llama3 configs already state the extended
        length (the rule vLLM applies, so the two agree on a model's context)."""
        if self.type in ("linear", "dynamic") and self.factor > 1:
            return int(max_position * self.factor)
        if self.type == "yarn":
            return int((self.original_max_position or max_position) * self.factor)
        return max_position

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        theta = scaling.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        return cls(
            theta=float(theta),
            type=rtype,
            factor=float(scaling.get("factor", 1.0)),
            original_max_position=scaling.get("original_max_position_embeddings"),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            beta_fast=float(scaling.get("beta_fast", 32.0)),
            beta_slow=float(scaling.get("beta_slow", 1.0)),
            attention_factor=scaling.get("attention_factor"),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The decoder's shape. Shared by the target and by every MTP block."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_mtp_layers: int = 0
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"num_attention_heads {self.num_heads} is not a multiple "
                                  f"of num_key_value_heads {self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config field {name} must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def position_limit(self) -> int:
        """The longest sequence the model takes (`RopeConfig.position_limit`)."""
        return self.rope.position_limit(self.max_position)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str | None = None) -> ModelConfig:
        """Parse a HF config dict through its family. `architecture` overrides
        `architectures[0]`."""
        from chainspec.models.families import family_for
        arch = architecture or (cfg.get("architectures") or [None])[0]
        return family_for(arch).parse(cfg, arch)

    @classmethod
    def from_dir(cls, model_dir: str | Path, architecture: str | None = None) -> ModelConfig:
        cfg = read_hf_config(model_dir)
        try:
            return cls.from_hf(cfg, architecture)
        except KeyError as e:
            path = Path(model_dir) / "config.json"
            raise CheckpointError(f"{path}: missing required field {e.args[0]!r}") from e


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id` of a config (a list, one id or none) as a tuple."""
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The raw `config.json` of a model directory, as a dict."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: config.json not found") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return cfg

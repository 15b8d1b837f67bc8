"""MTP family adapters: checkpoint tensor names and glue mapped onto `MTPDraftModel`.

`MTPDraftModel` uses canonical names: `embed_tokens.weight`, `lm_head.weight` and, per
module i, `mtp.{i}.enorm.weight`, `mtp.{i}.hnorm.weight`, `mtp.{i}.eh_proj.weight`,
`mtp.{i}.block.<decoder layer names>`, `mtp.{i}.final_norm.weight`. An adapter says where
each lives in one family's checkpoints, which concat order and norm convention the glue
uses, and which config field counts the modules.

Every architecture chainspec drafts for is a target family (`models/families/`): an MTP
block is that family's own decoder layer (`Family.mtp_block`, shaped by `draft_config`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from chainspec.models.config import ModelConfig
from chainspec.models.errors import CheckpointError
from chainspec.models.mtp import MTPGlue

GLUE_PARTS = ("enorm", "hnorm", "eh_proj", "final_norm")
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
_CANONICAL = re.compile(r"mtp\.(\d+)\.(.+)")


@dataclass(frozen=True)
class MTPAdapter:
    """One MTP family. Templates take `{p}`, the module's layer prefix."""

    family: str
    glue: MTPGlue
    layer_prefix: str  # formatted with the module's layer index
    glue_names: dict[str, str]  # canonical glue part -> checkpoint name template
    namespace: str  # regex matching every checkpoint name the family's MTP owns
    count_keys: tuple[str, ...] = ("num_nextn_predict_layers",)
    offset_by_target_layers: bool = False  # layer index = num_hidden_layers + i
    shared_copies: tuple[str, ...] = ()  # per-module copies accepted and ignored
    zero_centred_block_norms: bool = False  # block norms stored as w for (1 + w)

    def __post_init__(self) -> None:
        if set(self.glue_names) - {"head"} != set(GLUE_PARTS):
            raise ValueError(f"{self.family}: glue_names must cover {GLUE_PARTS}")
        if ("head" in self.glue_names) != self.glue.own_heads:
            raise ValueError(f"{self.family}: a 'head' name goes with glue.own_heads")

    def num_modules(self, hf: dict[str, Any]) -> int:
        """How many MTP modules the config declares (0 when none); a multimodal
        release declares them in its `text_config`."""
        fields = {**(hf.get("text_config") or {}), **hf}
        return next((int(fields[k] or 0) for k in self.count_keys if k in fields), 0)

    def module_prefix(self, i: int, num_target_layers: int) -> str:
        offset = num_target_layers if self.offset_by_target_layers else 0
        return self.layer_prefix.format(offset + i)

    def checkpoint_name(self, canonical: str, num_target_layers: int) -> str:
        """Canonical `MTPDraftModel` name -> this family's checkpoint name."""
        if canonical in SHARED:
            return SHARED[canonical]
        match = _CANONICAL.fullmatch(canonical)
        if match is None:
            raise KeyError(f"not an MTPDraftModel tensor name: {canonical}")
        i, rest = int(match.group(1)), match.group(2)
        prefix = self.module_prefix(i, num_target_layers)
        if rest.startswith("block."):
            return prefix + rest.removeprefix("block.")
        part = rest.removesuffix(".weight")
        return self.glue_names[part].format(p=prefix)

    def owns(self, name: str, num_target_layers: int) -> bool:
        """Whether a checkpoint tensor belongs to this family's MTP modules."""
        match = re.match(self.namespace, name)
        if match is None:
            return False
        return not self.offset_by_target_layers or int(match.group(1)) >= num_target_layers

    def is_shared_copy(self, name: str, num_target_layers: int, num_modules: int) -> bool:
        prefixes = [self.module_prefix(i, num_target_layers) for i in range(num_modules)]
        return any(name == p + copy for p in prefixes for copy in self.shared_copies)

    def convert(self, canonical: str, tensor: torch.Tensor) -> torch.Tensor:
        """Bring a checkpoint tensor to the convention of chainspec's module."""
        is_block_norm = ".block." in canonical and canonical.endswith("norm.weight")
        if self.zero_centred_block_norms and is_block_norm:
            return tensor.float() + 1.0  # NOTE: chainspec's block norms scale by w, not 1 + w
        return tensor


DEEPSEEK = MTPAdapter(
    family="deepseek",
    glue=MTPGlue(hidden_first=False),
    layer_prefix="model.layers.{}.",
    glue_names={"enorm": "{p}enorm.weight", "hnorm": "{p}hnorm.weight",
                "eh_proj": "{p}eh_proj.weight", "final_norm": "{p}shared_head.norm.weight"},
    namespace=r"model\.layers\.(\d+)\.",
    offset_by_target_layers=True,
    shared_copies=("embed_tokens.weight", "shared_head.head.weight"),
)

MIMO = MTPAdapter(
    family="mimo",
    glue=MTPGlue(hidden_first=True),
    layer_prefix="model.mtp_layers.{}.",
    glue_names={"enorm": "{p}token_layernorm.weight", "hnorm": "{p}hidden_layernorm.weight",
                "eh_proj": "{p}input_proj.weight", "final_norm": "{p}final_layernorm.weight"},
    namespace=r"model\.mtp_layers\.",
)

QWEN3_NEXT = MTPAdapter(
    family="qwen3_next",
    # chained through mtp.norm: vLLM's qwen3_next_mtp.py returns the normed state
    glue=MTPGlue(hidden_first=False, unit_offset_norms=True, chains_normed=True),
    layer_prefix="mtp.layers.{}.",
    # NOTE: one fc and one set of glue norms shared by every module (vLLM's reading).
    glue_names={"enorm": "mtp.pre_fc_norm_embedding.weight",
                "hnorm": "mtp.pre_fc_norm_hidden.weight",
                "eh_proj": "mtp.fc.weight", "final_norm": "mtp.norm.weight"},
    namespace=r"mtp\.",
    count_keys=("mtp_num_hidden_layers", "num_nextn_predict_layers"),
)

# Qwen3-Next's and Qwen3.5's MTP blocks are their families' gated full-attention layers,
# whose norms are zero-centred natively (`families/qwen3_next.py`, `qwen3_5.py`): loaded
# unchanged.
# NOTE: both chain states through mtp.norm, as vLLM's and SGLang's MTP modules do
QWEN3_5 = replace(QWEN3_NEXT, family="qwen3_5")

# MiMo-V2-Flash (`families/mimo_v2_flash.py`): the hub's `model.mtp.layers.{i}.*`.
MIMO_V2 = MTPAdapter(
    family="mimo_v2",
    glue=MTPGlue(hidden_first=False, chains=False),  # every step reads the target's h
    layer_prefix="model.mtp.layers.{}.",
    glue_names={"enorm": "{p}enorm.weight", "hnorm": "{p}hnorm.weight",
                "eh_proj": "{p}eh_proj.weight", "final_norm": "{p}final_layernorm.weight"},
    namespace=r"model\.mtp\.",
)

# Step-3.5/3.7-Flash (`families/step3.py`): DeepSeek placement, each layer its own head.
STEP3 = MTPAdapter(
    family="step3",
    glue=MTPGlue(hidden_first=False, unit_offset_norms=True, own_heads=True),  # chained
    layer_prefix="model.layers.{}.",
    glue_names={"enorm": "{p}enorm.weight", "hnorm": "{p}hnorm.weight",
                "eh_proj": "{p}eh_proj.weight", "final_norm": "{p}shared_head.norm.weight",
                "head": "{p}shared_head.output.weight"},
    namespace=r"model\.layers\.(\d+)\.",
    offset_by_target_layers=True,
    shared_copies=("embed_tokens.weight",),
)

ADAPTERS = {a.family: a for a in (DEEPSEEK, MIMO, QWEN3_NEXT, QWEN3_5, MIMO_V2, STEP3)}

# Checkpoint architectures with an MTP family of their own. Target families (Llama, ...)
# that carry `num_nextn_predict_layers` use DeepSeek naming (the demo model does).
ARCHITECTURE_FAMILIES = {
    "DeepseekV3ForCausalLM": "deepseek",
    "Glm4MoeForCausalLM": "deepseek",
    "MiMoForCausalLM": "mimo",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "MiMoV2FlashForCausalLM": "mimo_v2",
    "Step3p5ForCausalLM": "step3",
}


def _target_architectures() -> list[str]:
    from chainspec.models.families import registry  # NOTE: families import adapters
    return list(registry())


def architecture_of(hf: dict[str, Any], override: str | None = None) -> str:
    arch = override or (hf.get("architectures") or [None])[0]
    if not arch:
        raise CheckpointError("config.json names no architecture (architectures[0])")
    return arch


def adapter_for(hf: dict[str, Any], architecture: str | None = None,
                family: str | None = None) -> MTPAdapter | None:
    """The MTP adapter of a config, or None when it declares no MTP modules.

    `family` ("deepseek", "mimo", "qwen3_next") overrides the choice by architecture.
    """
    if family is not None:
        if family not in ADAPTERS:
            raise CheckpointError(f"unknown MTP family {family!r}; known: "
                                  f"{', '.join(ADAPTERS)}")
        return ADAPTERS[family]
    arch = architecture_of(hf, architecture)
    if arch in ARCHITECTURE_FAMILIES:
        return ADAPTERS[ARCHITECTURE_FAMILIES[arch]]
    targets = _target_architectures()
    if arch not in targets:
        raise CheckpointError(f"unknown architecture {arch!r}; supported: "
                              f"{', '.join([*targets, *ARCHITECTURE_FAMILIES])}")
    return DEEPSEEK if DEEPSEEK.num_modules(hf) > 0 else None


def draft_config(hf: dict[str, Any], adapter: MTPAdapter,
                 architecture: str | None = None) -> ModelConfig:
    """The config of an MTP block: the target family's own, with the declared modules."""
    arch = architecture_of(hf, architecture)
    targets = _target_architectures()
    if arch not in targets:
        raise CheckpointError(f"unknown architecture {arch!r}; supported for drafting: "
                              f"{', '.join(targets)}")
    base = ModelConfig.from_hf(hf, arch)
    return replace(base, num_mtp_layers=adapter.num_modules(hf))

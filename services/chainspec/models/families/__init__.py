"""The supported model families, by checkpoint architecture (one file per family)."""

from __future__ import annotations

from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import Family


def _families() -> tuple[Family, ...]:
    from chainspec.models.families import (
        deepseek_v3,
        glm4_moe,
        glm4_moe_lite,
        llama,
        mimo_v2_flash,
        qwen3_5,
        qwen3_moe,
        qwen3_next,
        step3,
    )
    return (*llama.FAMILIES, *qwen3_5.FAMILIES, *deepseek_v3.FAMILIES, *mimo_v2_flash.FAMILIES,
            *step3.FAMILIES, *qwen3_next.FAMILIES, *glm4_moe.FAMILIES, *qwen3_moe.FAMILIES,
            *glm4_moe_lite.FAMILIES)


def registry() -> dict[str, Family]:
    """Architecture name -> family."""
    return {arch: f for f in _families() for arch in f.architectures}


def family_for(architecture: str | None) -> Family:
    """The family of an architecture; one line naming it and the supported ones if none."""
    families = registry()
    if architecture not in families:
        raise CheckpointError(f"unknown architecture {architecture!r}; supported "
                              f"targets: {', '.join(families)}")
    return families[architecture]

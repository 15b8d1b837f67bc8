"""The Qwen3.5 dense family (`Qwen3_5ForCausalLM`, config model_type `qwen3_5_text`), and
its releases (`Qwen3_5ForConditionalGeneration`, what the hub's 0.8B-27B dense checkpoints
are; config model_type `qwen3_5`); the MoE models (`Qwen3_5MoeForCausalLM`, model_type
`qwen3_5_moe_text`; releases `Qwen3_5MoeForConditionalGeneration`, model_type
`qwen3_5_moe`, e.g. Qwen3.5-35B-A3B) are the same layers with the `moe` MLP kind.

A release nests the text model's config in `text_config` (tie_word_embeddings and dtype
at the top level win, as transformers reads them) and stores its tensors as
`model.language_model.*` and `lm_head.weight`, beside a vision tower `model.visual.*`
and the MTP layer `mtp.*` (vLLM's `Qwen3_5ForConditionalGeneration` and `Qwen3_5MTP`
read the same names). chainspec serves the text model: the vision tower is left unread,
with one warning line; the drafter reads `mtp.*`, the embedding and the head. Text-only
positions are equal on MRoPE's three axes, so `mrope_section` reduces to plain RoPE.
Refused by name: MoE fields (`num_experts`) on a dense architecture, a release whose
text_config model_type is not its architecture's, an MTP layer with its own embedding
(`mtp_use_dedicated_embeddings`), layer types other than the two below.

Layer pattern: `layer_types` (default: three `linear_attention` then one
`full_attention`, `full_attention_interval` 4). Layer kinds:
- `linear` (`linear_attn.*`): Gated DeltaNet (`models/gated_deltanet.py`), a recurrent
  state per sequence;
- `full` (`self_attn.*`): GQA with an output gate (q_proj twice wide, [q, gate] per
  head), zero-centred q/k RMSNorm, partial RoPE (`partial_rotary_factor`, 0.25);
- MLP: dense SwiGLU on every layer; MoE models: `models/moe.py` on every layer (softmax
  top-k, always renormalised -- transformers' Qwen3.5-MoE router has no `norm_topk_prob`
  -- plus a `shared_expert` gated by sigmoid(`shared_expert_gate`)), the MTP layer too.
Every RMSNorm but the GDN's gated one scales by (1 + w): chainspec's `RMSNorm` with
`unit_offset`, so checkpoint tensors load unchanged (same rounding as transformers).

MTP glue (`mtp.*`, vLLM's `qwen3_5_mtp.py` layout):

| | |
|---|---|
| tensors | `mtp.fc` (eh_proj), `mtp.pre_fc_norm_embedding` (enorm), |
| | `mtp.pre_fc_norm_hidden` (hnorm), `mtp.layers.{i}.*`, `mtp.norm` (final norm); |
| | embedding and head shared with the target |
| concat | [emb, hidden] |
| hidden read | h after the target's final norm (the exported h) |
| token offset | step k at row p reads x[p+k] |
| chain | one module reused for K steps (`mtp_num_hidden_layers` 1), chained through |
| | `mtp.norm`, as vLLM's `qwen3_5_mtp.py` and SGLang's do (`MTPGlue.chains_normed`) |
| layer kind | one `full_attention` layer with output gate (paged KV, no state); its MLP |
| | dense, or MoE for the MoE models |
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from chainspec.models.adapters import QWEN3_5
from chainspec.models.cache_spec import CacheSpec
from chainspec.models.config import ModelConfig, RopeConfig, eos_ids
from chainspec.models.errors import CheckpointError
from chainspec.models.families.base import DecoderParts, Family, MTPBlock
from chainspec.models.gated_deltanet import GatedDeltaNet, GDNShape
from chainspec.models.layers import MLP, Attention, AttentionBackend, RMSNorm
from chainspec.models.moe import MoEConfig, Scoring, SparseMoE
from chainspec.models.rope import RotaryEmbedding

LINEAR, FULL = "linear_attention", "full_attention"
RELEASE_TEXT = "model.language_model."  # a release's text model tensors
RELEASE_VISION = "model.visual."  # a release's vision tower: not served
MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


@dataclass(frozen=True)
class Qwen3_5Config(ModelConfig):
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    mtp_dedicated_embeddings: bool = False
    moe: MoEConfig | None = None  # the MoE MLP kind's shape (None: dense)
    sparse: tuple[bool, ...] = ()  # per layer: MoE MLP; then the MTP layer's (one more)

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_layers:
            raise CheckpointError(f"layer_types has {len(self.layer_types)} entries for "
                                  f"{self.num_layers} layers")
        unknown = set(self.layer_types) - {LINEAR, FULL}
        if unknown:
            raise CheckpointError(f"unsupported layer types {sorted(unknown)}")

    @property
    def gdn_shape(self) -> GDNShape:
        return GDNShape(self.linear_num_key_heads, self.linear_num_value_heads,
                        self.linear_key_head_dim, self.linear_value_head_dim,
                        self.linear_conv_kernel, self.rms_eps)


def layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    interval = int(cfg.get("full_attention_interval", 4))
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))


def moe_config(cfg: dict[str, Any]) -> MoEConfig:
    """Qwen3.5-MoE's block: softmax top-k, always renormalised, a gated shared expert."""
    moe = MoEConfig.from_hf(cfg, Scoring.SOFTMAX, norm_default=True)
    return replace(moe, router=replace(moe.router, norm_topk_prob=True))


def parse(cfg: dict[str, Any], arch: str) -> Qwen3_5Config:
    is_moe = arch in MOE_ARCHITECTURES
    if cfg.get("num_experts") and not is_moe:
        raise CheckpointError(f"{arch}: MoE text model (num_experts {cfg['num_experts']}) "
                              f"on a dense architecture; MoE is Qwen3_5MoeForCausalLM")
    if is_moe and not cfg.get("num_experts"):
        raise CheckpointError(f"{arch}: no num_experts in the config of an MoE architecture")
    moe = moe_config(cfg) if is_moe else None
    return replace(parse_hybrid(cfg, arch), moe=moe,
                   sparse=(is_moe,) * (int(cfg["num_hidden_layers"]) + 1))


def parse_hybrid(cfg: dict[str, Any], arch: str) -> Qwen3_5Config:
    """The fields Qwen3.5 and Qwen3-Next share (attention, GDN, MTP count); dense MLPs."""
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = RopeConfig.from_hf(cfg)
    partial = (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    bias = bool(cfg.get("attention_bias", False))
    return Qwen3_5Config(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position=int(cfg.get("max_position_embeddings", 32768)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias, o_bias=bias, qk_norm=True,
        rope=replace(rope, partial_rotary_factor=float(partial)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        num_mtp_layers=QWEN3_5.num_modules(cfg),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        layer_types=layer_types(cfg),
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        mtp_dedicated_embeddings=bool(cfg.get("mtp_use_dedicated_embeddings", False)),
    )


def text_config(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """A release's text model config: `text_config`, with the top-level fields
    transformers reads there (tie_word_embeddings, dtype)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{arch}: config has no text_config object")
    want = "qwen3_5_moe_text" if arch in MOE_ARCHITECTURES else "qwen3_5_text"
    kind = text.get("model_type", want)
    if kind != want:
        raise CheckpointError(f"{arch}: text_config model_type {kind!r} is not supported; "
                              f"{want} only")
    top = {k: cfg[k] for k in ("tie_word_embeddings", "torch_dtype", "dtype") if k in cfg}
    return {**text, **top}


def parse_release(cfg: dict[str, Any], arch: str) -> Qwen3_5Config:
    return parse(text_config(cfg, arch), arch)


def release_name(key: str) -> str:
    """Canonical `TargetModel` key -> a release's tensor name: the text model under
    `model.language_model.`; `lm_head.*` and `mtp.*` unchanged."""
    return RELEASE_TEXT + key.removeprefix("model.") if key.startswith("model.") else key


class HybridDecoderLayer(nn.Module):
    """Pre-norm token mixer (`linear_attn`: Gated DeltaNet, or `self_attn`: gated full
    attention) and MLP, with zero-centred norms. The MLP kind is the config's (`mlp_for`);
    `gdn` the family's GDN projections (Qwen3-Next passes its fused ones)."""

    def __init__(self, cfg: Qwen3_5Config, layer_id: int, rotary: RotaryEmbedding,
                 kind: str, mlp: nn.Module | None = None,
                 gdn: type[GatedDeltaNet] = GatedDeltaNet) -> None:
        super().__init__()
        if kind == LINEAR:
            self.linear_attn = gdn(cfg.hidden_size, cfg.gdn_shape, layer_id)
        else:
            self.self_attn = Attention(cfg, layer_id, rotary, output_gate=True,
                                       unit_offset_norms=True)
        self.kind = kind
        self.mlp = mlp if mlp is not None else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps,
                                                unit_offset=True)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.kind == LINEAR else self.self_attn

    def cache_spec(self) -> CacheSpec:
        return self.mixer.cache_spec()

    def forward(self, x, positions, backend: AttentionBackend):
        x = x + self.mixer(self.input_layernorm(x), positions, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


def _rotary(cfg: ModelConfig, cache_len: int | None) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position, cache_len)


def mlp_for(cfg: Qwen3_5Config, layer: int) -> nn.Module:
    """Layer `layer`'s MLP (`num_layers`: the MTP layer's): MoE where `sparse` says so."""
    if cfg.moe is not None and cfg.sparse[layer]:
        return SparseMoE(cfg.moe)
    return MLP(cfg)


def build(cfg: Qwen3_5Config, cache_len: int | None,
          gdn: type[GatedDeltaNet] = GatedDeltaNet) -> DecoderParts:
    rotary = _rotary(cfg, cache_len)
    layers = [HybridDecoderLayer(cfg, i, rotary, kind, mlp_for(cfg, i), gdn)
              for i, kind in enumerate(cfg.layer_types)]
    return DecoderParts(layers, [rotary], RMSNorm(cfg.hidden_size, cfg.rms_eps, True))


def mtp_block(cfg: Qwen3_5Config, cache_len: int | None) -> MTPBlock:
    if cfg.mtp_dedicated_embeddings:
        raise CheckpointError(f"{cfg.architecture}: an MTP layer with its own embedding "
                              f"(mtp_use_dedicated_embeddings) is not supported")
    rotary = _rotary(cfg, cache_len)
    return MTPBlock(HybridDecoderLayer(cfg, 0, rotary, FULL, mlp_for(cfg, cfg.num_layers)),
                    [rotary])


QWEN3_5_DENSE = Family(
    name="qwen3_5",
    architectures=("Qwen3_5ForCausalLM",),
    parse=parse, build=build, mtp=QWEN3_5, mtp_block=mtp_block,
    notes="Gated DeltaNet + gated full attention (3:1), dense SwiGLU; MTP at mtp.*, "
          "[emb, hidden], reads h after the final norm, one full-attention layer",
)
QWEN3_5_RELEASE = replace(
    QWEN3_5_DENSE, architectures=("Qwen3_5ForConditionalGeneration",),
    parse=parse_release, checkpoint_name=release_name, unread=(RELEASE_VISION,),
    notes=QWEN3_5_DENSE.notes + "; releases: text model at model.language_model.*, "
          "vision tower model.visual.* left unread",
)
QWEN3_5_MOE = replace(
    QWEN3_5_DENSE, name="qwen3_5_moe", architectures=("Qwen3_5MoeForCausalLM",),
    notes="Gated DeltaNet + gated full attention (3:1), MoE on every layer (softmax top-k, "
          "renormalised, gated shared expert); MTP at mtp.*, one full-attention MoE layer",
)
QWEN3_5_MOE_RELEASE = replace(
    QWEN3_5_RELEASE, name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration",),
    notes=QWEN3_5_MOE.notes + "; releases: text model at model.language_model.*",
)
FAMILIES = (QWEN3_5_DENSE, QWEN3_5_RELEASE, QWEN3_5_MOE, QWEN3_5_MOE_RELEASE)

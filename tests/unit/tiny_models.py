"""Tiny random models for engine tests."""

from __future__ import annotations

import torch

from chainspec.models.config import ModelConfig
from chainspec.models.mtp import MTPDraftModel, MTPGlue
from chainspec.models.target import TargetModel


def tiny_config(vocab: int = 61, hidden: int = 32, layers: int = 2, mtp: int = 2) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=2 * hidden, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=hidden // 4, max_position=512,
                       tie_word_embeddings=True, num_mtp_layers=mtp)


def tiny_draft_model(num_modules: int = 2, seed: int = 0, **kw) -> MTPDraftModel:
    torch.manual_seed(seed)
    model = MTPDraftModel(tiny_config(mtp=num_modules, **kw), num_modules, MTPGlue())
    for p in model.parameters():  # sharper logits than the default init, fewer argmax ties
        p.data.normal_(0, 0.5 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


def tiny_target(seed: int = 0, **kw) -> TargetModel:
    torch.manual_seed(seed)
    model = TargetModel(tiny_config(**kw))
    for p in model.parameters():
        p.data.normal_(0, 0.5 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()

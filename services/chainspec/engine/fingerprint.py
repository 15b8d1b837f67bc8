"""A short fingerprint of the weights a verifier and its drafters must share.

Both sides hold the token embedding and the LM head (the drafter's MTP modules are not
on the verifier), so the fingerprint covers exactly those two. Values are hashed as
bfloat16 bits, so the same checkpoint loaded in float32 on one side and bfloat16 on the
other gives the same fingerprint.
"""

from __future__ import annotations

import hashlib

import torch

from chainspec.models.mtp import MTPDraftModel
from chainspec.models.target import TargetModel

ROWS_PER_CHUNK = 4096  # bounds the host copy of a large embedding


def weights_fingerprint(named: dict[str, torch.Tensor]) -> str:
    """blake2b-128 over (name, shape, bf16 bits) of each tensor, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(named):
        t = named[name].detach()
        h.update(f"{name}:{list(t.shape)};".encode())
        flat = t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(1, -1)
        for r0 in range(0, flat.shape[0], ROWS_PER_CHUNK):
            chunk = flat[r0:r0 + ROWS_PER_CHUNK].to(torch.bfloat16).view(torch.int16)
            h.update(chunk.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def shared_weights(model: MTPDraftModel | TargetModel) -> dict[str, torch.Tensor]:
    if isinstance(model, TargetModel):
        return {"embed": model.model.embed_tokens.weight, "head": model.lm_head.weight}
    return {"embed": model.embed_tokens.weight, "head": model.lm_head.weight}


def model_fingerprint(model: MTPDraftModel | TargetModel) -> str:
    """The pairing fingerprint of a drafter's or a verifier's model (a tensor-parallel
    group's rank 0 computes its own over every rank's rows: `engine/tp_group.py`)."""
    if hasattr(model, "fingerprint"):
        return model.fingerprint()
    return weights_fingerprint(shared_weights(model))

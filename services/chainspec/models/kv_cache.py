"""A KV cache of fixed slots: one sequence per slot, one tensor pair per layer."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values `[num_slots, max_len, kv_heads, head_dim]` for each layer.

    Allocated once at full size and never reallocated (CUDA graphs read it in place).
    A slot holds one sequence; row p of a slot holds position p.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.num_slots = num_slots
        self.max_len = max_len
        # NOTE: one spare row past the end of each flat store absorbs the writes of
        # padding rows (slot -1), so writes need neither a branch nor a host sync.
        flat = num_slots * max_len + 1
        self._flat_k = [torch.zeros(flat, num_kv_heads, head_dim, dtype=dtype, device=device)
                        for _ in range(num_layers)]
        self._flat_v = [torch.zeros(flat, num_kv_heads, head_dim, dtype=dtype, device=device)
                        for _ in range(num_layers)]
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        self.keys = [t[:-1].view(shape) for t in self._flat_k]
        self.values = [t[:-1].view(shape) for t in self._flat_v]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat_k + self._flat_v)

    def write(self, layer: int, slot_mapping: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[T, kv_heads, head_dim]` at (slot, position); slot -1 writes nowhere."""
        trash = self.num_slots * self.max_len
        index = slot_mapping * self.max_len + positions  # [T]
        index = torch.where(slot_mapping >= 0, index, torch.full_like(index, trash))
        self._flat_k[layer].index_copy_(0, index, k.to(self._flat_k[layer].dtype))
        self._flat_v[layer].index_copy_(0, index, v.to(self._flat_v[layer].dtype))

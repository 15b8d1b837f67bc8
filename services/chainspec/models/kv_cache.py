"""A paged KV cache: a pool of fixed-size blocks per layer, shared by all sequences.

A sequence owns a list of blocks (its block table); position p lives in block
table[p // block_size] at offset p % block_size, i.e. at flat slot
`block * block_size + offset`. Who owns which block is the engine's business
(`engine/block_allocator.py`); this class only holds the tensors.
"""

from __future__ import annotations

import torch


class PagedKVCache:
    """Keys and values `[num_blocks, block_size, kv_heads, head_dim]` for each layer.

    Allocated once at full size and never reallocated (CUDA graphs read it in place).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device)
                       for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, keys and values."""
    elem = torch.finfo(dtype).bits // 8
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

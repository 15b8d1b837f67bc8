"""A model's cache: one entry per layer, shaped by the layer's cache spec (DESIGN 2.4).

Paged layers hold keys and values `[num_blocks, block_size, kv_heads, head_dim]` in
blocks shared by all sequences: position p of a sequence lives in block
table[p // block_size] at offset p % block_size, i.e. at flat slot
`block * block_size + offset`. Layers with equal `group_key` (full length, or one window
size) share block ids, so each group has its own block count. A latent layer (MLA) holds
one tensor and reads its values as a view of the keys' leading channels.

Recurrent layers hold `[slots, rows_kept, *shape]` per state part: a slot per running
sequence and a copy after each row of a verify window.

Who owns which block or slot is the engine's business; this class only holds the
tensors, allocated once at full size and never reallocated (CUDA graphs read them in
place).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from chainspec.models.cache_spec import CacheSpec, PagedSpec, StateSpec


@dataclass(frozen=True)
class PagedLayer:
    spec: PagedSpec
    keys: torch.Tensor  # [blocks, block_size, Hkv, Dk]
    values: torch.Tensor  # [blocks, block_size, Hkv, Dv] (latent: a view of keys)


class ModelKVCache:
    def __init__(self, specs: Sequence[CacheSpec], num_blocks: Mapping[int | None, int],
                 block_size: int, state_slots: int = 0, state_rows: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 separate_windows: bool = True) -> None:
        """`num_blocks`: per group key (None = full length, else the window size).
        `separate_windows` False: windowed layers keep every position in the full-length
        group (masked by their window, nothing given back; the drafter's choice)."""
        self.specs = tuple(specs)
        self.block_size = block_size
        self.group_blocks = dict(num_blocks)
        self.separate_windows = separate_windows
        self._layers: list[PagedLayer | tuple[torch.Tensor, ...]] = []
        for i, spec in enumerate(self.specs):
            if isinstance(spec, PagedSpec):
                n = self.group_blocks[self.group_key(i)]
                tensors = [torch.zeros(s, dtype=dtype, device=device)
                           for s in spec.shapes(n, block_size)]
                values = tensors[0][..., :spec.value_dim] if spec.latent else tensors[1]
                self._layers.append(PagedLayer(spec, tensors[0], values))
            else:
                self._layers.append(tuple(
                    torch.zeros(state_slots, state_rows, *s, dtype=dtype, device=device)
                    for s in spec.shapes))

    @classmethod
    def uniform(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> ModelKVCache:
        """Full-attention layers of one shape (a Llama-family stack, an MTP drafter)."""
        return cls([PagedSpec(num_kv_heads, head_dim)] * num_layers, {None: num_blocks},
                   block_size, dtype=dtype, device=device)

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    @property
    def num_blocks(self) -> int:
        """Blocks of the full-length group."""
        return self.group_blocks[None]

    def group_key(self, layer: int) -> int | None:
        """The block-table group of a paged layer: None (full length) or its window."""
        spec = self.specs[layer]
        return spec.group_key if self.separate_windows else None

    @property
    def windows(self) -> tuple[int, ...]:
        """Window sizes of the windowed groups (each with its own block tables)."""
        if not self.separate_windows:
            return ()
        return tuple(sorted({s.window for s in self.specs
                             if isinstance(s, PagedSpec) and s.window is not None}))

    @property
    def has_states(self) -> bool:
        return any(isinstance(s, StateSpec) for s in self.specs)

    def paged(self, layer: int) -> PagedLayer:
        entry = self._layers[layer]
        if not isinstance(entry, PagedLayer):
            raise ValueError(f"layer {layer} keeps a recurrent state, not paged KV")
        return entry

    def state(self, layer: int) -> tuple[torch.Tensor, ...]:
        entry = self._layers[layer]
        if isinstance(entry, PagedLayer):
            raise ValueError(f"layer {layer} keeps paged KV, not a recurrent state")
        return entry

    @property
    def keys(self) -> list[torch.Tensor]:
        return [e.keys for e in self._layers if isinstance(e, PagedLayer)]

    @property
    def values(self) -> list[torch.Tensor]:
        return [e.values for e in self._layers if isinstance(e, PagedLayer)
                and not e.spec.latent]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache owns (latent values are views, not listed)."""
        out: list[torch.Tensor] = []
        for e in self._layers:
            out.extend([e.keys] + ([] if e.spec.latent else [e.values])
                       if isinstance(e, PagedLayer) else list(e))
        return out

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, keys and values (uniform full layers)."""
    return num_layers * PagedSpec(num_kv_heads, head_dim).bytes_per_block(block_size, dtype)

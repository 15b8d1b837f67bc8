"""Training batches: random windows of a token stream, from a seeded generator."""

from __future__ import annotations

import torch


class WindowSampler:
    """Draws `[batch, seq_len]` windows at uniform random offsets of a 1-D stream.

    Sharded (rank r of `world`): every rank draws the same global batch of
    `batch_size * world` offsets and keeps rows r*B..(r+1)*B, so the ranks' shares are
    disjoint, together equal one unsharded sampler's batch of `batch_size * world`, and
    the generator state (what a checkpoint saves) is the same on every rank."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world: int = 1) -> None:
        if stream.numel() <= seq_len:
            raise ValueError(f"token stream ({stream.numel()}) shorter than seq_len {seq_len}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.stream = stream
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank, self.world = rank, world
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        high = self.stream.numel() - self.seq_len
        starts = torch.randint(0, high + 1, (self.batch_size * self.world,),
                               generator=self.generator)
        mine = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        offsets = torch.arange(self.seq_len)
        return self.stream[mine[:, None] + offsets[None, :]]  # [B, T]


def consecutive_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` non-overlapping windows of a stream -> [n, seq_len] (n <= count)."""
    n = min(count, stream.numel() // seq_len)
    return stream[: n * seq_len].view(n, seq_len)

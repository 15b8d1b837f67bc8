"""Training batches: random windows of a token stream, from a seeded generator."""

from __future__ import annotations

import torch


class WindowSampler:
    """Draws `[batch, seq_len]` windows at uniform random offsets of a 1-D stream."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        if stream.numel() <= seq_len:
            raise ValueError(f"token stream ({stream.numel()}) shorter than seq_len {seq_len}")
        self.stream = stream
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        high = self.stream.numel() - self.seq_len
        starts = torch.randint(0, high + 1, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len)
        return self.stream[starts[:, None] + offsets[None, :]]  # [B, T]


def consecutive_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` non-overlapping windows of a stream -> [n, seq_len] (n <= count)."""
    n = min(count, stream.numel() // seq_len)
    return stream[: n * seq_len].view(n, seq_len)

"""The data of the multi-process runs (`ddp train`, `parallel train`) and of their one-process references:
a fixed pool of random token sequences from which step i draws the same shuffled global batch on every
rank and in the reference; rank r of a data-parallel group of W trains on rows [r·B, (r+1)·B) of it."""

from __future__ import annotations

import torch


class BatchSource:
    """A fixed pool of sequences; step i draws a shuffled global batch (deterministic in seed and i)."""

    def __init__(self, *, vocab_size: int, seq_len: int, global_batch: int, seed: int, pool_factor: int = 4):
        gen = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, vocab_size, (global_batch * pool_factor, seq_len + 1), generator=gen)
        self.global_batch = global_batch
        self.seed = seed

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = torch.randperm(self.pool.shape[0], generator=gen)[:self.global_batch]
        seqs = self.pool[rows]
        return seqs[:, :-1], seqs[:, 1:]  # inputs, next-token targets: [G, S] each

    def local_batch_at(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.global_batch_at(step)
        b = self.global_batch // world
        return inputs[rank * b:(rank + 1) * b], targets[rank * b:(rank + 1) * b]


def to_device(batch, device) -> tuple[torch.Tensor, ...]:
    """The batch on `device`, contiguous: BatchSource's inputs and targets are slices of one [G, S+1] pool
    row; a copy to a GPU packs them anyway, on the CPU the loss's flatten would copy the targets each step."""
    return tuple(t.to(device).contiguous() for t in batch)

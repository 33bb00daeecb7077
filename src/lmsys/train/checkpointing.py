"""Activation checkpointing applied to a model from outside: its blocks regrouped into segments whose
activations are recomputed in backward instead of stored."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


class CheckpointedSegment(torch.nn.Module):
    """Consecutive blocks whose activations are recomputed in backward instead of stored."""

    def __init__(self, blocks: list[torch.nn.Module]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def _run(self, x, cos, sin):
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def forward(self, x, cos, sin):
        return checkpoint(self._run, x, cos, sin, use_reentrant=False)


def apply_activation_checkpointing(model: torch.nn.Module, segment: int) -> None:
    """Group model.layers into checkpointed segments of `segment` blocks (1 = every block)."""
    blocks = list(model.layers)
    model.layers = torch.nn.ModuleList(
        CheckpointedSegment(blocks[i:i + segment]) for i in range(0, len(blocks), segment)
    )


def checkpoint_forward(module: torch.nn.Module) -> None:
    """Make `module` recompute its activations in backward, in place: its own forward runs under a
    non-reentrant checkpoint. Its parameter names and the hooks on it (a DDP's, an FSDP unit's) stay
    as they were: the hooks fire once around the call, the recompute runs the forward alone."""
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward

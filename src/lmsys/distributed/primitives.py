"""The flat collectives the data-parallel wrappers are built from (DDP, ZeRO-1, FSDP).

Each takes `group=None`, the process group it runs on (None: the default group, every rank), so that a
device mesh can hand each one its group. The single-tensor all-gather / reduce-scatter are the newest
names this torch has (all_gather_single / reduce_scatter_single from torch 2.13, where the *_tensor
names are deprecated; all_gather_into_tensor / reduce_scatter_tensor before).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ALL_GATHER_OP", "REDUCE_SCATTER_OP", "all_gather_flat", "reduce_scatter_flat", "all_reduce_flat",
           "broadcast_module_state"]

# the names of the single-tensor calls all_gather_flat / reduce_scatter_flat make on this torch
ALL_GATHER_OP = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_OP = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False):
    """output (n·k elements) <- every rank's input (k elements), in rank order."""
    return getattr(dist, ALL_GATHER_OP)(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False):
    """output (k elements) <- the sum over ranks of this rank's k-element chunk of input (n·k)."""
    return getattr(dist, REDUCE_SCATTER_OP)(output, input, group=group, async_op=async_op)


def all_reduce_flat(tensors: list[torch.Tensor], *, op=dist.ReduceOp.SUM, prescale: Optional[float] = None,
                    group=None) -> list[torch.Tensor]:
    """Flatten -> one all-reduce -> unflatten: `tensors` (one dtype and device) concatenated into one
    buffer, scaled by `prescale` if given, reduced with `op`; returns views of the reduced buffer shaped
    like the inputs. FlatDDP reduces its gradients with it, FSDP where reduce-scatter is missing."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if prescale is not None:
        flat.mul_(prescale)
    dist.all_reduce(flat, op=op, group=group)
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def broadcast_module_state(module: nn.Module, *, src: int = 0, group=None) -> None:
    """Every parameter and buffer of `module` takes rank `src`'s values (`src`: a rank of `group`,
    default the world)."""
    if group is not None:
        src = dist.get_global_rank(group, src)
    with torch.no_grad():
        tensors = list(module.parameters()) + list(module.buffers())
        works = [dist.broadcast(t.data, src=src, group=group, async_op=True) for t in tensors]
        for work in works:
            work.wait()

"""Fully sharded data parallelism, written out: each rank keeps 1/world of every weight matrix.

`FSDP(module, compute_dtype=None)`:
- Parameters with >= 2 dims (Linear and Embedding weights) are split along dim 0: rank r keeps rows
  [r·k, (r+1)·k) with k = ceil(rows / world) (zero-padded at the end). These shards are the parameters
  the optimizer sees, so weights, gradients and optimizer state of them are ~1/world per rank.
- 1-D parameters (norm gains) stay replicated; their gradients are all-reduced (averaged) by
  `finish_gradient_synchronization()`.
- A module that owns a sharded weight gets it all-gathered right before its forward (a forward
  pre-hook) and dropped after (a forward hook). What autograd would save of it for backward is replaced
  by a note (saved-tensor hooks, active inside `FSDP.forward`) and all-gathered again when backward
  needs it, then dropped. The gather's backward reduce-scatters the full weight's gradient into the
  shard (and divides by world: the average over ranks, i.e. the full-batch gradient when the loss is a
  mean over equal local batches).
- With `compute_dtype` (e.g. torch.bfloat16), shards are cast before the all-gather, so communication
  and compute happen in that dtype, as do the other parameters of those modules (a Linear's bias);
  master weights and gradients stay fp32 (gradients are reduce-scattered in fp32).
- `gather_full_params()` returns full fp32 copies keyed by the wrapped module's parameter names.

All ranks must run the same modules in the same order (every gather is a collective). Collectives are
synchronous: this is the memory-saving mechanism, not an overlapped implementation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lmsys.distributed.ddp import broadcast_module_state, presence_flags

__all__ = ["FSDP"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _ShardedParam:
    """One sharded weight: its shard (an nn.Parameter), full shape, and the modules that use it."""

    def __init__(self, name: str, full: nn.Parameter, *, rank: int, world: int):
        self.name = name
        self.shape = full.shape
        self.rows = full.shape[0]
        self.rows_per_rank = -(-self.rows // world)  # ceil
        self.world = world
        with torch.no_grad():
            padded = full.new_zeros((self.rows_per_rank * world, *self.shape[1:]))
            padded[:self.rows] = full
            local = padded[rank * self.rows_per_rank:(rank + 1) * self.rows_per_rank].clone()
        self.shard = nn.Parameter(local, requires_grad=full.requires_grad)

    def gather(self, dtype: Optional[torch.dtype]) -> torch.Tensor:
        """The full weight (no autograd), in `dtype` (or the shard's); a view of the padded buffer."""
        shard = self.shard.detach()
        if dtype is not None and dtype != shard.dtype:
            shard = shard.to(dtype)
        out = shard.new_empty((self.rows_per_rank * self.world, *self.shape[1:]))
        _all_gather(out, shard.contiguous())
        return out[:self.rows]

    def reduce_scatter_grad(self, grad_full: torch.Tensor) -> torch.Tensor:
        """Full-weight gradient (any float dtype) -> this rank's shard of the average over ranks (fp32)."""
        grad = grad_full.to(self.shard.dtype)
        if self.rows_per_rank * self.world == self.rows:
            padded = grad.contiguous()
        else:
            padded = grad.new_zeros((self.rows_per_rank * self.world, *self.shape[1:]))
            padded[:self.rows] = grad
        out = grad.new_empty((self.rows_per_rank, *self.shape[1:]))
        _reduce_scatter(out, padded)
        return out.div_(self.world)


class _GatherWeight(torch.autograd.Function):
    """forward: all-gather the shard into the full weight; backward: reduce-scatter its gradient."""

    @staticmethod
    def forward(ctx, shard, entry: _ShardedParam, dtype):
        ctx.entry = entry
        return entry.gather(dtype)

    @staticmethod
    def backward(ctx, grad_full):
        return ctx.entry.reduce_scatter_grad(grad_full), None, None


class _Regather:
    """What autograd keeps instead of a gathered weight: enough to gather it again in backward."""

    def __init__(self, entry: _ShardedParam, dtype, size, stride, offset):
        self.entry, self.dtype, self.size, self.stride, self.offset = entry, dtype, size, stride, offset


class FSDP(nn.Module):
    def __init__(self, module: nn.Module, compute_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised torch.distributed process group")
        self.module = module
        self.compute_dtype = compute_dtype
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        broadcast_module_state(module)

        original = list(module.named_parameters())  # tied weights: listed once, under the first name
        self._names = [name for name, _ in original]

        self._sharded: dict[int, _ShardedParam] = {}  # id(original parameter) -> its shard
        for name, p in original:
            if p.dim() >= 2:
                self._sharded[id(p)] = _ShardedParam(name, p, rank=self.rank, world=self.world_size)
        self._by_name = {name: self._sharded.get(id(p), p) for name, p in original}

        # Every parameter of a module that owns a sharded weight is provided by that module's hooks.
        self._managed: dict[nn.Module, list[tuple[str, object]]] = {}  # module -> [(attr, entry or param)]
        extra: list[nn.Parameter] = []
        for mod in module.modules():
            owned = [(attr, p) for attr, p in mod._parameters.items() if p is not None]
            if not any(id(p) in self._sharded for _, p in owned):
                continue
            slots = []
            for attr, p in owned:
                del mod._parameters[attr]
                slots.append((attr, self._sharded.get(id(p), p)))
                if id(p) not in self._sharded and not any(p is q for q in extra):
                    extra.append(p)
            self._managed[mod] = slots
            mod.register_forward_pre_hook(self._before_forward)
            mod.register_forward_hook(self._after_forward)
        self.shards = nn.ParameterList([e.shard for e in self._sharded.values()])  # what the optimizer sees,
        self.managed_params = nn.ParameterList(extra)  # with those modules' other (replicated) parameters
        shard_ids = {id(e.shard) for e in self._sharded.values()}
        self._replicated = [p for p in self.parameters() if id(p) not in shard_ids]
        self._live: dict[int, _ShardedParam] = {}  # storage pointer of a gathered weight -> its entry

    # ------------------------------------------------------------------------------- forward, backward

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _before_forward(self, mod: nn.Module, args) -> None:
        for attr, item in self._managed[mod]:
            if isinstance(item, _ShardedParam):
                full = _GatherWeight.apply(item.shard, item, self.compute_dtype)
                self._live[full.untyped_storage().data_ptr()] = item
            elif self.compute_dtype is not None and item.is_floating_point():
                full = item.to(self.compute_dtype)
            else:
                full = item
            mod.__dict__[attr] = full

    def _after_forward(self, mod: nn.Module, args, output) -> None:
        for attr, item in self._managed[mod]:
            full = mod.__dict__.pop(attr, None)
            if isinstance(item, _ShardedParam) and full is not None:
                self._live.pop(full.untyped_storage().data_ptr(), None)

    def _pack(self, t: torch.Tensor):
        if not self._live:
            return t
        try:
            entry = self._live.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
            return t
        if entry is None:
            return t
        return _Regather(entry, t.dtype, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, _Regather):
            return saved
        full = saved.entry.gather(saved.dtype)  # a view at offset 0 of a fresh padded buffer
        return full.as_strided(saved.size, saved.stride, saved.offset)

    # --------------------------------------------------------------------------------------- after backward

    def finish_gradient_synchronization(self) -> None:
        """Average the replicated parameters' gradients (sharded ones were reduce-scattered in backward)."""
        params = [p for p in self._replicated if p.requires_grad]
        if not params:
            return
        device = params[0].device
        present = [p.grad is not None for p in params]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params] + [presence_flags(present, dtype=torch.float32, device=device)])
        dist.all_reduce(flat)
        if all(present):  # present here, so present somewhere
            anywhere = [True] * len(params)
        else:
            anywhere = (flat[flat.numel() - len(params):] > 0).tolist()
        flat.div_(self.world_size)
        offset = 0
        for p, used in zip(params, anywhere):
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype) if used else None
            offset += n

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 copies of every parameter, by the wrapped module's names (a collective: all ranks)."""
        out = {}
        for name in self._names:
            item = self._by_name[name]
            if isinstance(item, _ShardedParam):
                out[name] = item.gather(torch.float32).clone()
            else:
                out[name] = item.detach().float().clone()
        return out


"""Hand-written data parallelism, from one all-reduce per parameter to overlapped buckets.

Every class wraps a model (`.module`), broadcasts its parameters and buffers from rank 0 when built,
delegates `forward`, and after `loss.backward()` the caller runs `finish_gradient_synchronization()`,
which leaves every rank with the gradient averaged over ranks (so the optimizer steps identically
everywhere):

- `NaiveDDP`: one blocking all-reduce per parameter after backward.
- `FlatDDP`: all gradients flattened into one buffer (one per dtype), one all-reduce after backward.
- `OverlapDDP`: an asynchronous all-reduce per parameter, launched from a post-accumulate-grad hook as
  soon as that gradient is ready; finish waits on them.
- `BucketedDDP`: parameters in reverse registration order (roughly the order backward produces their
  gradients) packed into buckets of at most `bucket_size_mb` MiB; each bucket is one flat buffer and the
  parameters' `.grad` become views into it (kept if the optimizer zeroes gradients in place; after
  `zero_grad(set_to_none=True)`, which measured faster on 2×H200, each gradient is copied in once); a bucket
  is all-reduced asynchronously as soon as all its gradients are ready. Optionally the buckets are
  communicated in bf16 (`comm_dtype`), halving the bytes, at the cost of rounding the averaged gradient.
  Optionally (`sm_carveout`), from the first bucket's all-reduce until finish, cuBLAS matmuls leave that
  many SMs to NCCL (`MatmulCarveout`): NCCL's kernels hold their SMs for as long as they run, and a
  persistent GEMM sized for every SM then waits a second wave for the SMs NCCL holds.
  Optionally (`copy_engine`, GPUs of one host), the buckets are all-reduced by the copy engines over
  NVLink instead of NCCL's kernels (lmsys.distributed.data_parallel.copy_engine), leaving every SM to the backward.

Shared rules:
- Parameters with `requires_grad=False` are skipped; a parameter reached twice (tied weights) is
  reduced once (`module.parameters()` yields it once; its hook fires once, after both uses accumulate).
- Collectives are issued in one fixed order on every rank (hooks may fire in another order; a ready
  parameter or bucket waits for its predecessors), so ranks never pair different tensors.
- A parameter without a gradient this step takes part with zeros; if no rank had a gradient for it,
  its `.grad` stays None, as in single-process training (a small all-reduce of "has a gradient" flags
  decides). Averages are over all ranks, which equals the full-batch gradient when local batches are
  equal-sized and the loss is a mean.
- One backward per step: a gradient that becomes ready twice before `finish_gradient_synchronization()`
  is an error (gradient accumulation without sync is not supported).

Averaging: NCCL divides inside the collective (ReduceOp.AVG); gloo sums and the gradient is scaled by
1/world first (exact for powers of two).
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lmsys.core.devices import MatmulCarveout
from lmsys.core.parsing import MiB
from lmsys.distributed.primitives import all_reduce_flat, broadcast_module_state  # re-exported: DDP's names


__all__ = ["NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP", "all_reduce_flat",
           "broadcast_module_state"]


def _averaging_op(group=None) -> tuple[dist.ReduceOp, Optional[float]]:
    """(op, prescale): AVG where the backend has it (NCCL), else SUM of gradients scaled by 1/world."""
    if dist.get_backend() == "nccl":
        return dist.ReduceOp.AVG, None
    return dist.ReduceOp.SUM, 1.0 / dist.get_world_size(group)


def presence_flags(present: list[bool], *, dtype, device) -> torch.Tensor:
    """1 where this rank has a gradient, else 0, built on the device: `torch.tensor(list, device=cuda)`
    would be a blocking copy that waits for all queued work (the whole backward)."""
    flags = torch.ones(len(present), dtype=dtype, device=device)
    for i, here in enumerate(present):
        if not here:
            flags[i] = 0
    return flags


class GradPresence:
    """Which parameters have a gradient on at least one rank (one small all-reduce of flags). Every rank
    takes part; the result is read on the host (a synchronisation) only when this rank lacks a gradient,
    since a gradient present here is present somewhere."""

    def __init__(self, present: list[bool], device, group=None):
        self.present = present
        self.flags = presence_flags(present, dtype=torch.int32, device=device)
        self.work = dist.all_reduce(self.flags, group=group, async_op=True) if present else None

    def anywhere(self) -> list[bool]:
        if self.work is not None:
            self.work.wait()
        if all(self.present):
            return [True] * len(self.present)
        return [count > 0 for count in self.flags.tolist()]


class _DataParallel(nn.Module):
    """Common part: wrap, broadcast, the trainable parameters, forward delegation. `group`: the process
    group gradients are averaged over (a mesh's dp group; default the world). `require_grad_sync = False`
    leaves the gradients to accumulate locally (microbatches before the last, as torch DDP's no_sync)."""

    def __init__(self, module: nn.Module, *, group=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised torch.distributed process group")
        self.module = module
        self.group = group
        self.require_grad_sync = True
        self.world_size = dist.get_world_size(group)
        broadcast_module_state(module, group=group)
        self._params = [p for p in module.parameters() if p.requires_grad]  # tied weights appear once
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._op, self._prescale = _averaging_op(group)
        self._index_of = {id(p): i for i, p in enumerate(self._params)}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _register_grad_ready_hooks(self, params: list[nn.Parameter]) -> None:
        """`self._on_grad_ready` as every parameter's post-accumulate-grad hook, through a weak reference:
        the hooks live on the parameters, which the wrapper holds, and a strong reference back would keep
        model, gradients and buckets alive after the wrapper is dropped (the cycle runs through autograd's
        C++ side, which the garbage collector cannot see). The hooks are removed when the wrapper dies."""
        method = weakref.WeakMethod(self._on_grad_ready)

        def hook(param):
            bound = method()
            if bound is not None:
                bound(param)

        handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        weakref.finalize(self, lambda: [h.remove() for h in handles])

    def on_train_batch_start(self) -> None:
        """Per-step state reset (nothing to reset here)."""

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError


class NaiveDDP(_DataParallel):
    """One blocking all-reduce per parameter, after backward."""

    def finish_gradient_synchronization(self) -> None:
        present = [p.grad is not None for p in self._params]
        for p in self._params:
            if p.grad is None:  # no gradient here this step: take part with zeros
                p.grad = torch.zeros_like(p)
            if self._prescale is not None:
                p.grad.mul_(self._prescale)
            dist.all_reduce(p.grad, op=self._op, group=self.group)
        for p, anywhere in zip(self._params, GradPresence(present, self._device, self.group).anywhere()):
            if not anywhere:
                p.grad = None


class FlatDDP(_DataParallel):
    """All gradients in one flat buffer per dtype, one all-reduce each; the "has a gradient" flags ride
    along at the end of the first buffer."""

    def finish_gradient_synchronization(self) -> None:
        groups: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self._params:
            groups.setdefault(p.dtype, []).append(p)
        present = [p.grad is not None for p in self._params]
        reduced = []
        for i, (dtype, params) in enumerate(groups.items()):
            parts = [(p.grad if p.grad is not None else torch.zeros_like(p)) for p in params]
            if i == 0:  # flags: 1 per parameter present here; after the sum, >0 means some rank had one
                parts.append(presence_flags(present, dtype=dtype, device=self._device))
            # the prescale scales the flags too: they only need to stay > 0
            reduced.append(all_reduce_flat(parts, op=self._op, prescale=self._prescale, group=self.group))
        if not reduced:
            return
        if all(present):  # present here, so present somewhere: no need to read the flags
            any_rank = [True] * len(present)
        else:
            any_rank = (reduced[0][-1] > 0).tolist()
        used = dict(zip(map(id, self._params), any_rank))
        for views, params in zip(reduced, groups.values()):
            for p, view in zip(params, views):
                p.grad = view if used[id(p)] else None


class OverlapDDP(_DataParallel):
    """An async all-reduce per parameter, launched from its post-accumulate-grad hook."""

    def __init__(self, module: nn.Module, *, group=None):
        super().__init__(module, group=group)
        self._order = list(reversed(self._params))  # launch order: roughly backward's order
        self._index = {id(p): i for i, p in enumerate(self._order)}
        self._register_grad_ready_hooks(self._order)
        self._reset()

    def _reset(self) -> None:
        self._ready = [False] * len(self._order)
        self._next = 0  # the first parameter not launched yet
        self._works: list = [None] * len(self._order)

    def on_train_batch_start(self) -> None:
        self._drain()

    def _drain(self) -> None:
        for work in self._works:
            if work is not None:
                work.wait()
        self._reset()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        i = self._index[id(param)]
        if self._ready[i]:
            raise RuntimeError("a gradient became ready twice in one step: call "
                               "finish_gradient_synchronization() after every backward")
        self._ready[i] = True
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._order) and self._ready[self._next]:
            p = self._order[self._next]
            if p.grad is None:  # no gradient here this step: take part with zeros
                p.grad = torch.zeros_like(p)
            if self._prescale is not None:
                p.grad.mul_(self._prescale)
            self._works[self._next] = dist.all_reduce(p.grad, op=self._op, group=self.group, async_op=True)
            self._next += 1

    def finish_gradient_synchronization(self) -> None:
        present = [p.grad is not None for p in self._order]
        self._ready = [True] * len(self._order)  # whatever is left goes now, in order
        self._launch_ready()
        anywhere = GradPresence(present, self._device, self.group).anywhere()
        for p, work, used in zip(self._order, self._works, anywhere):
            work.wait()
            if not used:
                p.grad = None
        self._reset()


BUCKET_ORDERS = ("reverse", "learned")


class StepInFinish(torch.optim.Optimizer):
    """The optimizer the training loop sees when BucketedDDP steps one optimizer per bucket inside
    finish_gradient_synchronization(): step() has nothing left to do; zero_grad and state go to the
    per-bucket optimizers."""

    def __init__(self, ddp_model: "BucketedDDP"):
        self._ddp = ddp_model
        super().__init__([p for b in ddp_model.buckets for p in b.params] or [torch.zeros(1)], {})

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self._ddp.bucket_optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for opt in self._ddp.bucket_optimizers for st in opt.state.values()
                for t in st.values() if torch.is_tensor(t)]


class _Bucket:
    """Parameters sharing one flat communication buffer; `views[k]` is parameter k's slice of it."""

    def __init__(self, params: list[nn.Parameter], *, comm_dtype: Optional[torch.dtype],
                 buffer: Optional[torch.Tensor] = None):
        self.params = params
        dtype = params[0].dtype
        device = params[0].device
        total = sum(p.numel() for p in params)
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.comm_dtype = comm_dtype or dtype
        # what is all-reduced: its own, or a slice of a shared buffer (the copy-engine all-reduce's)
        self.buffer = buffer if buffer is not None else torch.zeros(total, dtype=self.comm_dtype, device=device)
        self.views = [self._slice(self.buffer, k) for k in range(len(params))]
        if self.comm_dtype != dtype:  # the .grad views live in a buffer of the parameters' dtype
            self.grad_buffer = torch.zeros(total, dtype=dtype, device=device)
            self.grad_views = [self._slice(self.grad_buffer, k) for k in range(len(params))]
        else:
            self.grad_buffer = self.buffer
            self.grad_views = self.views
        self.reset()

    def _slice(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        p = self.params[k]
        return flat[self.offsets[k]:self.offsets[k] + p.numel()].view_as(p)

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.work = None


class BucketedDDP(_DataParallel):
    """Buckets of at most `bucket_size_mb` MiB of gradients (reverse registration order), each
    all-reduced asynchronously as soon as all its gradients are ready."""

    def __init__(self, module: nn.Module, bucket_size_mb: float, *, comm_dtype: Optional[torch.dtype] = None,
                 bucket_order: str = "reverse", grad_views: bool = False, optimizer_factory=None,
                 sm_carveout: Optional[int] = None, copy_engine: bool = False, group=None):
        super().__init__(module, group=group)
        if not bucket_size_mb > 0 or math.isinf(bucket_size_mb):
            raise ValueError(f"bucket_size_mb must be a positive number, got {bucket_size_mb}")
        if bucket_order not in BUCKET_ORDERS:
            raise ValueError(f"bucket_order must be one of {BUCKET_ORDERS}, got {bucket_order!r}")
        self.bucket_size_mb = bucket_size_mb
        self.comm_dtype = comm_dtype
        self.grad_views = grad_views
        self._optimizer_factory = optimizer_factory
        self.carveout = MatmulCarveout(sm_carveout, self._device) if sm_carveout is not None else None
        self.copy_engine = copy_engine
        if copy_engine:
            if self._device.type != "cuda" or comm_dtype is not None or any(
                    p.dtype != torch.float32 for p in self._params):
                raise ValueError("copy_engine needs fp32 parameters on CUDA GPUs and no comm_dtype")
            self._op, self._prescale = dist.ReduceOp.SUM, 1.0 / self.world_size  # the sum is the mean
        self._learning = bucket_order == "learned"  # the first backward's hook order, then re-planned
        self._fired: list[nn.Parameter] = []
        self._build_buckets(list(reversed(self._params)))
        self._register_grad_ready_hooks(self._params)
        self._next = 0  # the first bucket not launched yet

    def _build_buckets(self, order: list[nn.Parameter]) -> None:
        plan = self._plan_buckets(order, self.bucket_size_mb * MiB)
        buffers = [None] * len(plan)
        self._ce = None
        if self.copy_engine:
            from lmsys.distributed.data_parallel.copy_engine import CopyEngineAllReduce
            from lmsys.distributed.launch import timeout_seconds

            self._ce = CopyEngineAllReduce([sum(p.numel() for p in ps) for ps in plan], self._device,
                                           timeout_s=timeout_seconds())
            buffers = [self._ce.bucket(b) for b in range(len(plan))]
        self.buckets = [_Bucket(ps, comm_dtype=self.comm_dtype, buffer=buf) for ps, buf in zip(plan, buffers)]
        # device memory torch's peak statistics miss: the symmetric buffer is mapped outside its allocator
        self.unaccounted_bytes = self._ce.nbytes if self._ce is not None else 0
        self._slot = {id(p): (b, k) for b, bucket in enumerate(self.buckets) for k, p in enumerate(bucket.params)}
        # optional: one optimizer per bucket, stepped as soon as that bucket's all-reduce is done
        self.bucket_optimizers = ([self._optimizer_factory(bucket.params) for bucket in self.buckets]
                                  if self._optimizer_factory is not None else None)

    def _relearn_order(self) -> None:
        """After the first step: buckets in the order the gradients became ready (rank 0's, so every
        rank packs the same buckets); parameters that never fired go last, in reverse registration order.
        Optimizer state of per-bucket optimizers is carried over by parameter."""
        fired = [self._index_of[id(p)] for p in self._fired]
        orders = [fired]
        dist.broadcast_object_list(orders, src=0 if self.group is None else dist.get_global_rank(self.group, 0), group=self.group)
        seen = set(orders[0])
        order = [self._params[i] for i in orders[0]]
        order += [p for p in reversed(self._params) if self._index_of[id(p)] not in seen]
        old = self.bucket_optimizers
        self._build_buckets(order)
        if old is not None:
            state = {id(p): st for opt in old for p, st in opt.state.items()}
            for opt in self.bucket_optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        if id(p) in state:
                            opt.state[p] = state[id(p)]
        self._learning = False

    @staticmethod
    def _plan_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
        """Greedy packing in the given order; a new bucket when the cap would be passed or the dtype or
        device changes. A parameter larger than the cap ends up alone in its bucket."""
        buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > cap_bytes or p.dtype != current[0].dtype
                            or p.device != current[0].device):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(current)
        return buckets

    def on_train_batch_start(self) -> None:
        """Reset per-step state; waits for any all-reduce still in flight (safe to call every step).
        With grad_views, the gradients start each step as zeroed views of the buckets (one memset per
        bucket), so autograd accumulates straight into them (torch DDP's gradient_as_bucket_view)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.reset()
            if self.grad_views:
                bucket.grad_buffer.zero_()
                for p, view in zip(bucket.params, bucket.grad_views):
                    p.grad = view
        self._next = 0

    def _stage(self, bucket: _Bucket, k: int) -> None:
        """Put parameter k's gradient, averaged in advance where needed, into the bucket's buffer."""
        p = bucket.params[k]
        view, grad_view = bucket.views[k], bucket.grad_views[k]
        grad = p.grad
        if grad is None:  # no gradient here this step
            view.zero_()
            return
        if grad.data_ptr() == view.data_ptr() and grad.dtype == view.dtype:
            if self._prescale is not None:
                view.mul_(self._prescale)
            return
        if self._prescale is not None:
            torch.mul(grad, self._prescale, out=view)  # copy-in fused with the 1/world scaling
        else:
            view.copy_(grad)
        if grad.data_ptr() != grad_view.data_ptr():
            p.grad = grad_view  # autograd accumulates into the bucket until grads are set to None;
            # in bf16 mode the values arrive at finish

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.require_grad_sync:
            return
        if self._learning:
            self._fired.append(param)
        b, k = self._slot[id(param)]
        bucket = self.buckets[b]
        if bucket.ready[k]:
            raise RuntimeError("a gradient became ready twice in one step: call "
                               "finish_gradient_synchronization() after every backward")
        self._stage(bucket, k)
        bucket.ready[k] = True
        bucket.n_ready += 1
        if bucket.n_ready == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].n_ready == len(self.buckets[self._next].params):
            bucket = self.buckets[self._next]
            if self.carveout is not None:  # NCCL runs beside the backward from here until finish
                self.carveout.on()
            if self._ce is not None:
                bucket.work = self._ce.launch(self._next)
            else:
                bucket.work = dist.all_reduce(bucket.buffer, op=self._op, group=self.group, async_op=True)
            self._next += 1

    def finish_gradient_synchronization(self) -> None:
        present = [p.grad is not None for bucket in self.buckets for p in bucket.params]
        for bucket in self.buckets[self._next:]:
            for k in range(len(bucket.params)):
                if not bucket.ready[k]:
                    self._stage(bucket, k)
                    bucket.ready[k] = True
                    bucket.n_ready += 1
        self._launch_ready()
        if self.carveout is not None:  # the backward's matmuls are done
            self.carveout.off()
        anywhere = iter(GradPresence(present, self._device, self.group).anywhere())
        for b, bucket in enumerate(self.buckets):
            bucket.work.wait()
            if bucket.grad_buffer is not bucket.buffer:
                bucket.grad_buffer.copy_(bucket.buffer)  # bf16 average -> the parameters' dtype
            for p, grad_view in zip(bucket.params, bucket.grad_views):
                p.grad = grad_view if next(anywhere) else None
            if self.bucket_optimizers is not None:  # overlaps the all-reduces of the later buckets
                self.bucket_optimizers[b].step()
            bucket.reset()
        self._next = 0
        if self._learning:
            self._relearn_order()

"""Fully sharded data parallelism, written out: per-unit flat shards, prefetched gathers, async reductions.

`FSDP(module, compute_dtype=None, *, units=None)`:
- **Units.** Every child of an `nn.ModuleList` (a TransformerBlock of `model.layers`) is a unit; the
  rest of the model (embeddings, final norm, LM head, and any parameter shared between units, i.e. tied
  weights) is the root unit. `units=` names the unit modules explicitly.
- **One flat shard per unit.** A unit's trainable parameters, 1-D ones included, are flattened into one
  fp32 buffer, zero-padded to a multiple of the world size; rank r keeps the r-th 1/world of it as one
  `nn.Parameter` (what the optimizer sees: weights, gradients and optimizer state are ~1/world per rank).
  Frozen parameters get a second flat shard of their own (no gradient).
- **Forward.** A unit's pre-hook waits for its gather (or gathers now), then issues the all-gather of
  the NEXT unit (registration order) on a side CUDA stream, before the current unit's compute is queued;
  the shard is cast to `compute_dtype` before the gather (bf16: half the bytes). The unit's modules see
  views of the gathered flat buffer (split of one leaf: autograd produces one flat gradient per unit).
  After a block unit's forward its full buffer's storage is resized to 0; the root stays gathered until
  its gradient is reduced.
- **Backward.** An identity autograd function on each block unit's outputs fires when their gradient
  arrives, before the unit's own backward: it gathers the unit again into the same storage (the saved
  views become valid again; the gathered buffer's version counter is not the leaf's, so autograd's
  in-place check is not tripped) and prefetches the unit before it in this step's forward order. When
  the unit's flat gradient is complete (a post-accumulate-grad hook on the leaf) it is cast to fp32 and
  reduce-scattered on a second side stream, asynchronously; the full parameters and gradient are freed.
  `finish_gradient_synchronization()` waits for the reductions (the caller runs it before the optimizer)
  and sets each shard's `.grad` to the average over ranks (accumulating if a `.grad` is already there).
- **Streams and the caching allocator.** Full buffers are allocated on the compute stream; a side
  stream waits for the compute stream before writing into one, and the compute stream waits for the
  gather's event before reading it, and frees it only after its last reader is queued, so the allocator
  never hands out memory in flight. A gradient read by the reduce-scatter stream is `record_stream`-ed.
  On the CPU (gloo) there are no streams: the same code runs synchronously.
- `gather_full_params()` returns full fp32 copies keyed by the wrapped module's parameter names.
- `group=`: the ranks parameters are sharded over (a mesh's dp group; default the world).
  `reshard=False`: a unit stays gathered from its first forward of a step until
  `finish_gradient_synchronization()`, so several forwards may run before their backwards (microbatches
  of a pipeline schedule); each backward reduce-scatters its unit's gradient, the shards accumulate
  them. `gather_root()` installs the root unit for a forward that does not enter through `forward`.
- `with fsdp.timed(timer, "dp"):` (a core.timing.RegionTimer) puts this wrapper's communication into
  that region while the block runs: on a GPU the compute stream's waits for an all-gather (a unit's
  pre-forward / pre-backward) and for the reduce-scatters (in `finish_gradient_synchronization`), i.e.
  what the prefetch and the backward did not hide, as bucketed DDP's "dp" region is the wait for its
  buckets; on the CPU (no streams) the collectives themselves, which run inline. Without it nothing is
  timed and nothing changes.

All ranks must run the same units in the same order, forward and backward (every gather is a
collective), each unit once per step. fp32 (`compute_dtype=None`) trains like one process on the full
batch up to the order of summation.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lmsys.distributed.primitives import all_gather_flat, all_reduce_flat, broadcast_module_state, reduce_scatter_flat

__all__ = ["FSDP"]


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group=None) -> None:
    """Sum of `flat` over ranks, this rank's 1/world slice into `out`. gloo lacks reduce_scatter_tensor
    on some torch versions: there, one all-reduce and a slice (the same numbers, twice the bytes)."""
    if getattr(_reduce_scatter, "fallback", False):
        summed = all_reduce_flat([flat], group=group)[0]
        n, rank = out.numel(), dist.get_rank(group)
        out.copy_(summed[rank * n:(rank + 1) * n])
        return
    try:
        reduce_scatter_flat(out, flat, group=group)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        if dist.get_backend() == "nccl":
            raise
        _reduce_scatter.fallback = True  # every rank fails the same way before communicating
        del exc
        _reduce_scatter(out, flat, group)


class _FlatGroup:
    """Some parameters of one unit as one flat buffer: the fp32 shard this rank keeps, and the full
    buffer (in the compute dtype) whose storage exists only while the unit is gathered."""

    def __init__(self, params: list[nn.Parameter], *, rank: int, world: int, compute_dtype, trainable: bool,
                 group=None):
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"FSDP: one unit's parameters must share a dtype, got {sorted(map(str, dtypes))}")
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        self.world, self.group = world, group
        self.shard_numel = -(-total // world)
        self.padded = self.shard_numel * world
        self.pad = self.padded - total
        device = params[0].device
        with torch.no_grad():
            flat = torch.zeros(self.padded, dtype=params[0].dtype, device=device)
            torch.cat([p.detach().reshape(-1) for p in params], out=flat[:total])
            local = flat[rank * self.shard_numel:(rank + 1) * self.shard_numel].clone()
        self.shard = nn.Parameter(local, requires_grad=trainable)
        self.trainable = trainable
        self.gather_dtype = compute_dtype or params[0].dtype
        self.full = torch.empty(self.padded, dtype=self.gather_dtype, device=device)
        self._nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)

    # storage of the gathered buffer -------------------------------------------------------------
    def allocate(self) -> None:
        if self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self._nbytes)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    @property
    def allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def all_gather(self) -> None:
        """The shard, cast to the gather dtype, all-gathered into `full` (on the current stream)."""
        src = self.shard.detach()
        if src.dtype != self.gather_dtype:
            src = src.to(self.gather_dtype)
        with torch.no_grad():
            all_gather_flat(self.full, src, group=self.group)

    def views(self, requires_grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(leaf, per-parameter views): the leaf shares `full`'s storage but not its version counter,
        so gathering into `full` again does not invalidate what autograd saved of the views."""
        leaf = self.full.data
        if requires_grad:
            leaf.requires_grad_(True)
        sizes = self.numels + ([self.pad] if self.pad else [])
        parts = leaf.split(sizes)
        return leaf, [part.view(shape) for part, shape in zip(parts, self.shapes)]


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs before the unit's own backward nodes."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class _Unit:
    """A module whose parameters are gathered and freed together."""

    def __init__(self, index: int, module: nn.Module, slots: list[tuple[nn.Module, str, nn.Parameter]],
                 *, root: bool, rank: int, world: int, compute_dtype, group=None):
        self.index, self.module, self.root = index, module, root
        # The original parameters are only read here (copied into the flat shards): keeping them in an
        # attribute kept every full fp32 weight alive (xl: +7.6 GB per rank on 2xH200).
        trainable_slots = [s for s in slots if s[2].requires_grad]
        frozen_slots = [s for s in slots if not s[2].requires_grad]
        self.groups: list[tuple[_FlatGroup, list]] = []
        for group_slots, trainable in ((trainable_slots, True), (frozen_slots, False)):
            if group_slots:
                unique = list({id(p): p for _, _, p in group_slots}.values())
                flat = _FlatGroup(unique, rank=rank, world=world, compute_dtype=compute_dtype,
                                  trainable=trainable, group=group)
                index_of = {id(p): i for i, p in enumerate(unique)}
                self.groups.append((flat, [(m, attr, index_of[id(p)]) for m, attr, p in group_slots]))
        self.state = "free"  # free | gathering | gathered
        self.event = None
        self.leaf: Optional[torch.Tensor] = None
        self.backward_started = False
        self.gathers = 0  # all-gathers issued (tests count them)


class FSDP(nn.Module):
    def __init__(self, module: nn.Module, compute_dtype: Optional[torch.dtype] = None, *,
                 units: Optional[Iterable[nn.Module]] = None, group=None, reshard: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("FSDP needs an initialised torch.distributed process group")
        self.module = module
        self.compute_dtype = compute_dtype
        self.group = group  # the ranks parameters are sharded over (a mesh's dp group; default the world)
        self.reshard = reshard
        self._timer = None  # (RegionTimer, region name) while `timed` is active
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        broadcast_module_state(module, group=group)
        named = list(module.named_parameters())  # tied weights: listed once, under the first name
        self._names = [name for name, _ in named]
        device = named[0][1].device if named else torch.device("cpu")
        self._streams = device.type == "cuda"
        if self._streams:
            self._gather_stream = torch.cuda.Stream(device)
            self._reduce_stream = torch.cuda.Stream(device)

        unit_modules = list(units) if units is not None else _default_units(module)
        self.units = self._build_units(module, unit_modules)
        self._locate = {}  # parameter name -> (unit, group index, position in the group)
        self._record_names(named)
        self.shards = nn.ParameterList([g.shard for u in self.units for g, _ in u.groups])
        self._blocks = [u for u in self.units if not u.root]
        self._root = self.units[0]
        self._pending: list[tuple[_FlatGroup, torch.Tensor, object]] = []
        self._order: list[_Unit] = []
        me = weakref.ref(self)
        for unit in self._blocks:
            unit.module.register_forward_pre_hook(_weak(me, "_before_unit_forward", unit))
            unit.module.register_forward_hook(_weak(me, "_after_unit_forward", unit))

    # -------------------------------------------------------------------------------------------- timing

    @contextmanager
    def timed(self, timer, region: str = "dp"):
        """Time this wrapper's communication in `timer`'s `region` while the block runs (module docstring)."""
        self._timer = (timer, region)
        try:
            yield self
        finally:
            self._timer = None

    def _comm(self):
        return nullcontext() if self._timer is None else self._timer[0].region(self._timer[1])

    # ------------------------------------------------------------------------------------ construction

    def _build_units(self, module: nn.Module, unit_modules: list[nn.Module]) -> list[_Unit]:
        owner: dict[int, int] = {}  # id(module) -> unit index (0: root)
        for i, unit_module in enumerate(unit_modules, start=1):
            for m in unit_module.modules():
                owner[id(m)] = i
        slots: dict[int, list[tuple[nn.Module, str, nn.Parameter]]] = {}
        where: dict[int, set[int]] = {}
        for m in module.modules():
            for attr, p in list(m._parameters.items()):
                if p is None:
                    continue
                slots.setdefault(id(p), []).append((m, attr, p))
                where.setdefault(id(p), set()).add(owner.get(id(m), 0))
        per_unit: list[list] = [[] for _ in range(len(unit_modules) + 1)]
        for pid, uses in slots.items():
            home = next(iter(where[pid])) if len(where[pid]) == 1 else 0  # shared across units: root
            per_unit[home].extend(uses)
        for uses in slots.values():
            for m, attr, _ in uses:
                del m._parameters[attr]
        mods = [module] + unit_modules
        return [_Unit(i, mods[i], per_unit[i], root=i == 0, rank=self.rank, world=self.world_size,
                      compute_dtype=self.compute_dtype, group=self.group) for i in range(len(mods))]

    def _record_names(self, named) -> None:
        position = {}
        for unit in self.units:
            for g, (group, slots) in enumerate(unit.groups):
                for m, attr, k in slots:
                    position.setdefault((id(m), attr), (unit, g, k))
        prefix_modules = dict(self.module.named_modules())
        for name, _ in named:
            mod_name, _, attr = name.rpartition(".")
            self._locate[name] = position[(id(prefix_modules[mod_name]), attr)]

    # --------------------------------------------------------------------------------------- gathering

    def _gather(self, unit: _Unit) -> None:
        """Issue unit's all-gather (on the side stream on a GPU); no-op if gathered or in flight."""
        if unit.state != "free":
            return
        for group, _ in unit.groups:
            group.allocate()  # on the compute stream: its pool owns the block
        unit.gathers += 1
        if not self._streams:
            with self._comm():
                for group, _ in unit.groups:
                    group.all_gather()
            unit.state = "gathered"
            return
        compute = torch.cuda.current_stream()
        self._gather_stream.wait_stream(compute)  # the block may be memory the compute stream just freed
        with torch.cuda.stream(self._gather_stream):
            for group, _ in unit.groups:
                group.all_gather()
            unit.event = self._gather_stream.record_event()
        unit.state = "gathering"

    def _wait(self, unit: _Unit) -> None:
        self._gather(unit)
        if unit.state == "gathering":
            with self._comm():  # the compute stream's wait: what the prefetch did not hide
                torch.cuda.current_stream().wait_event(unit.event)
            unit.event = None
        unit.state = "gathered"

    def _install(self, unit: _Unit) -> None:
        """The unit's modules get views of the gathered buffers as their parameters."""
        grad = torch.is_grad_enabled()
        unit.leaf = None
        for group, slots in unit.groups:
            leaf, views = group.views(requires_grad=grad and group.trainable)
            if grad and group.trainable:
                unit.leaf = leaf
                me = weakref.ref(self)
                leaf.register_post_accumulate_grad_hook(_weak(me, "_after_unit_backward", unit))
            for m, attr, k in slots:
                m.__dict__[attr] = views[k]
        unit.backward_started = False

    def _free(self, unit: _Unit, *, trainable_only: bool = False) -> None:
        """Release the gathered storage. After a unit's gradient is complete only its trainable group
        goes: an op on a frozen weight may still be ahead in backward (the rest goes at finish)."""
        for group, slots in unit.groups:
            if trainable_only and not group.trainable:
                continue
            group.free()
            for m, attr, _ in slots:
                m.__dict__.pop(attr, None)
        if not any(group.allocated for group, _ in unit.groups):
            unit.state = "free"

    def _prefetch_after(self, unit: _Unit, order: list[_Unit], step: int) -> None:
        if unit in order:
            i = order.index(unit) + step
            if 0 <= i < len(order):
                self._gather(order[i])

    # ----------------------------------------------------------------------------------- forward hooks

    def forward(self, *args, **kwargs):
        self._order = []
        for unit in self.units if self.reshard else ():  # left gathered by a forward without backward
            if unit.state != "free":
                self._wait(unit)
                self._free(unit)
        self.gather_root()
        return self.module(*args, **kwargs)

    def gather_root(self) -> None:
        """The root unit gathered and installed, the first block's gather issued (before a forward)."""
        self._wait(self._root)
        self._install(self._root)
        if self._blocks:
            self._gather(self._blocks[0])

    def _before_unit_forward(self, unit: _Unit, module, args) -> None:
        self._wait(unit)
        self._prefetch_after(unit, self._blocks, +1)  # before this unit's compute is queued
        self._install(unit)
        self._order.append(unit)

    def _after_unit_forward(self, unit: _Unit, module, args, output):
        if self.reshard:
            self._free(unit)
        if not torch.is_grad_enabled():
            return output
        me = weakref.ref(self)
        callback = _weak(me, "_before_unit_backward", unit)
        if isinstance(output, torch.Tensor):
            return _PreBackward.apply(callback, output)[0] if output.requires_grad else output
        if isinstance(output, (tuple, list)):
            idx = [i for i, t in enumerate(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not idx:
                return output
            wrapped = _PreBackward.apply(callback, *(output[i] for i in idx))
            out = list(output)
            for i, t in zip(idx, wrapped):
                out[i] = t
            return type(output)(out)
        return output

    # ---------------------------------------------------------------------------------- backward hooks

    def _before_unit_backward(self, unit: _Unit) -> None:
        if unit.backward_started:
            return
        unit.backward_started = True
        self._wait(unit)  # back into the storage autograd's saved views point at
        self._prefetch_after(unit, self._order, -1)

    def _after_unit_backward(self, unit: _Unit, leaf: torch.Tensor) -> None:
        grad = leaf.grad
        leaf.grad = None
        group = unit.groups[0][0]  # the trainable group
        grad32 = grad if grad.dtype == torch.float32 else grad.float()
        out = torch.empty(group.shard_numel, dtype=torch.float32, device=grad.device)
        if self._streams:
            compute = torch.cuda.current_stream()
            self._reduce_stream.wait_stream(compute)
            with torch.cuda.stream(self._reduce_stream):
                _reduce_scatter(out, grad32, self.group)
                grad32.record_stream(self._reduce_stream)
                event = self._reduce_stream.record_event()
        else:
            with self._comm():
                _reduce_scatter(out, grad32, self.group)
            event = None
        self._pending.append((group, out, event))
        unit.leaf = None
        del grad, grad32
        if self.reshard:
            self._free(unit, trainable_only=True)

    # --------------------------------------------------------------------------------------- after backward

    def finish_gradient_synchronization(self) -> None:
        """Wait for every unit's reduce-scatter; each shard's `.grad` is its slice of the rank average."""
        for group, out, event in self._pending:
            if event is not None:
                with self._comm():
                    torch.cuda.current_stream().wait_event(event)
            out.div_(self.world_size)
            if group.shard.grad is None:
                group.shard.grad = out
            else:
                group.shard.grad.add_(out)
        self._pending = []
        for unit in self.units:  # units without trainable parameters are freed here
            if unit.state != "free":
                self._wait(unit)
                self._free(unit)
            unit.leaf = None

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Full fp32 copies of every parameter, by the wrapped module's names (a collective: all ranks)."""
        flats = {}
        for unit in self.units:
            for g, (group, _) in enumerate(unit.groups):
                full = group.shard.new_empty(group.padded)
                all_gather_flat(full, group.shard.detach(), group=self.group)
                sizes = group.numels + ([group.pad] if group.pad else [])
                flats[(unit.index, g)] = [part.view(shape).float().clone()
                                          for part, shape in zip(full.split(sizes), group.shapes)]
        return {name: flats[(unit.index, g)][k] for name, (unit, g, k) in self._locate.items()}

    def gathered_units(self) -> int:
        """How many units hold gathered parameters now (0 between steps)."""
        return sum(any(g.allocated for g, _ in u.groups) for u in self.units)


def _default_units(module: nn.Module) -> list[nn.Module]:
    """The children of every nn.ModuleList not inside an earlier unit (a Transformer's blocks)."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList):
            continue
        for child in m:
            units.append(child)
            inside.update(id(c) for c in child.modules())
    return units


def _weak(ref, method: str, unit: _Unit):
    """A hook calling `ref().method(unit, ...)` without keeping the FSDP wrapper alive."""

    def hook(*args):
        owner = ref()
        if owner is not None:
            return getattr(owner, method)(unit, *args)
        return None

    return hook

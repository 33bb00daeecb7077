"""flash-triton's per-call host path: launch plans.

Everything a flash-triton call decides besides the tensors' addresses (the Gluon or tl kernel, the config
the tuner chose, the grid, the strides and lengths passed, whether TMA runs, the outputs to allocate) is a
function of the inputs' shapes, strides, dtypes, device and 16-byte alignment, `is_causal`, the `Policy`,
torch's float32 matmul precision (fp32's dots) and Triton's debug knobs. The first call with such a key
runs the normal path (lmsys.kernels.flash) with a `recording` on: every launch goes through `launch`
(which records the CompiledKernel that Triton's `JITFunction.run` returned, the grid and every argument)
and every output through `alloc`. `Plan.build` turns that into a plan; a later call with the same key
(`lookup`) allocates the outputs and calls each CompiledKernel's launcher directly, as `JITFunction.run` does after its own cache lookup, without the
launchers' Python, the tuner lookups, the descriptor checks and Triton's per-argument specialization. A
kernel taking tensor descriptors (the Gluon ones) goes one step further under triton 3.6 (`Expanded`): its
descriptors' CUtensorMaps are encoded once per address, not on every call.

Why the key is enough: Triton specializes a kernel on its arguments' types, on pointers' and integers'
divisibility by 16 and on integers equal to 1. The pointers are the inputs (alignment in the key) and
outputs `alloc` made (torch's blocks: 512-byte aligned); every integer is a length or a stride, functions
of the shapes and strides in the key. A call whose key differs in any of them builds its own plan; launch
hooks (profilers) are called as Triton calls them. The interpreter takes the normal path; so does any
recorded call the plan cannot replay: an argument not named at its launch, a copy of an input (a strided
view the Gluon kernel copies), an output that is not one `alloc` made (the atomic backward's cast). `ENABLED` is off under the
interpreter (tests turn it on: the plan then replays its arguments through Triton's normal launch) and
with LMSYS_FLASH_PLANS=0 (the path before plans, for comparison: `bench attention`'s `host µs` under either).

The rule for launchers: a plan replays only `alloc`, `launch` and `contiguous` (a copy of an input). Work
on tensors done any other way on a path that can be recorded (a torch op on an output, a copy kept) is not
replayed: route it through them, or make sure it leaves the call's tensors other than the inputs (a copy
fails the address check above).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import os

import torch
from triton import knobs as _knobs
from triton.runtime import driver as _driver

from lmsys.kernels import triton_interpreted
from lmsys.kernels.dots import matmul_precision

INTERPRET = triton_interpreted()
# plans on by default only where kernels are compiled; LMSYS_FLASH_PLANS=0: every call the normal path
ENABLED = not INTERPRET and os.environ.get("LMSYS_FLASH_PLANS") != "0"
MAX_PLANS = 512  # keys kept; past it the cache starts over (a sweep of many shapes)
NORMAL = "normal"  # a key whose calls take the normal path (see the module docstring)

_PLANS: dict = {}
_RECORD: contextvars.ContextVar = contextvars.ContextVar("lmsys_flash_plan_recording", default=None)
STATS = {"hits": 0, "misses": 0, "normal": 0}  # for tests and the host-overhead notes


class Recording:
    """What a normal call launched (`steps`) and allocated (`allocs`, by name), in order."""

    def __init__(self):
        self.steps: list = []
        self.allocs: dict = {}
        self.replayable = True


@contextlib.contextmanager
def recording(rec: Recording | None):
    """Launches and allocations inside are appended to `rec` (None: nothing recorded, nothing nested)."""
    token = _RECORD.set(rec)
    try:
        yield rec
    finally:
        _RECORD.reset(token)


def alloc(name: str, shape: tuple, dtype, device) -> torch.Tensor:
    """torch.empty of an output or scratch tensor a launch writes (every element: a plan replays no zeroing),
    named for plans."""
    t = torch.empty(shape, dtype=dtype, device=device)
    rec = _RECORD.get()
    if rec is not None:
        if name in rec.allocs:
            rec.replayable = False
        rec.allocs[name] = (t, tuple(shape), dtype, device)
    return t


def launch(fn, grid, args: tuple, kwargs: dict, names: tuple):
    """fn[grid](*args, **kwargs), Triton's normal launch; `names`: which call's tensor each leading argument
    is ("q", "k", ... the inputs; the others `alloc`'s names), for a plan being recorded."""
    kernel = fn[grid](*args, **kwargs)
    rec = _RECORD.get()
    if rec is not None:
        rec.steps.append((fn, kernel, grid, args, kwargs, names))
    return kernel


def contiguous(name: str, x: torch.Tensor) -> torch.Tensor:
    """x.contiguous() of the call's tensor `name` (x: a view of it), for a plan being recorded: the plan
    replays the copy and launches on it (a zero-stride gradient, as `.sum().backward()` hands the backward)."""
    y = x.contiguous()
    rec = _RECORD.get()
    if rec is not None and y is not x:
        rec.steps.append(("copy", name, y))
    return y


def key(head: tuple, tensors) -> tuple:
    """A plan's key: `head` (direction, causal, policy), Triton's knobs that enter its own kernel key, torch's
    float32 matmul precision (fp32's dots follow it: lmsys.kernels.dots), and each tensor's shape,
    strides, dtype, device and 16-byte alignment (one flat tuple: this runs on every call)."""
    runtime = _knobs.runtime
    parts = [head, runtime.debug, getattr(_knobs.compilation, "instrumentation_mode", None),
             matmul_precision()]
    for t in tensors:
        parts += (t.shape, t.stride(), t.dtype, t.get_device(), not t.data_ptr() & 15)
    return tuple(parts)


def lookup(k: tuple):
    """The plan of key k, NORMAL, or None (not seen: record one)."""
    plan = _PLANS.get(k)
    if plan is None:
        STATS["misses"] += 1
    elif plan is NORMAL:
        STATS["normal"] += 1
    else:
        STATS["hits"] += 1
    return plan


def store(k: tuple, plan) -> None:
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    _PLANS[k] = plan


def clear() -> None:
    _PLANS.clear()
    for name in STATS:
        STATS[name] = 0


@functools.lru_cache(maxsize=None)
def _params(fn) -> tuple:
    """(name, default) of a jit function's parameters, in order."""
    return tuple((p.name, p.default) for p in inspect.signature(fn.fn).parameters.values())


def _bound(fn, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """Every parameter's value in order (constexprs too: what Triton's launcher takes) and the options."""
    params = _params(fn)
    values = list(args)
    for name, default in params[len(args):]:
        values.append(kwargs[name] if name in kwargs else default)
    names = {name for name, _ in params}
    return values, {k: v for k, v in kwargs.items() if k not in names}


def _is_descriptor(x) -> bool:
    return hasattr(x, "base") and hasattr(x, "block_shape")


def _rebase(desc, base):
    """A copy of a tensor descriptor over `base` (same shape, strides, block and layout): what the launcher
    reads of it is base.data_ptr() and those, so the checks of its constructor need not run again."""
    try:
        new = object.__new__(type(desc))
        new.__dict__.update(desc.__dict__)
        new.base = base
        return new
    except (AttributeError, TypeError):
        return dataclasses.replace(desc, base=base)


def _like(inputs: dict, t: torch.Tensor) -> str | None:
    """The name of an input `torch.empty_like` would remake the allocation `t` from (same shape, dtype, device
    and strides: empty_like keeps a dense input's strides, and the plan's key keeps them), or None. Half the
    host time of torch.empty(shape, dtype=, device=): the gradients and the backward's D are such."""
    return next((name for name, x in inputs.items() if x.shape == t.shape and x.dtype == t.dtype
                 and x.device == t.device and x.stride() == t.stride()), None)


class Copy:
    """A recorded `contiguous`: the call's tensor `name`, viewed as `shape`, replaced by a contiguous copy."""

    __slots__ = ("name", "shape")
    direct = False

    def __init__(self, name: str, shape: tuple):
        self.name, self.shape = name, shape

    def apply(self, env: dict) -> None:
        env[self.name] = env[self.name].reshape(self.shape).contiguous()


class Step:
    """One recorded launch: the compiled kernel and its launcher, the grid, the arguments with the tensors'
    places left to fill (`slots`: (index, name, descriptor template or None))."""

    __slots__ = ("fn", "kernel", "grid", "template", "slots", "options", "direct", "run", "function", "packed",
                 "expand")

    def __init__(self, fn, kernel, grid: tuple, template: list, slots: tuple, options: dict, direct: bool):
        self.fn, self.kernel, self.grid, self.template = fn, kernel, grid, template
        self.slots, self.options, self.direct = slots, options, direct
        self.expand = None
        if direct:
            self.run, self.function, self.packed = kernel.run, kernel.function, kernel.packed_metadata
            self.expand = Expanded.of(self)

    def args(self, env: dict, ints: bool = False) -> list:
        """The arguments on `env`'s tensors; `ints`: plain tensors as their addresses, which Triton's launcher
        takes as they are where for a tensor it calls data_ptr() and then cuPointerGetAttribute (a driver
        call under the driver's lock); the plan's key has already checked device, dtype and alignment."""
        args = self.template.copy()
        for i, name, desc in self.slots:
            t = env[name]
            args[i] = (t.data_ptr() if ints else t) if desc is None else _rebase(desc, t)
        return args


class Expanded:
    """A step whose kernel takes tensor descriptors, launched as Triton 3.6's launcher would launch it,
    with each descriptor's CUtensorMap encoded once per base address instead of on every call.

    Triton 3.6 wraps a compiled launcher taking descriptors (`CudaLauncher.launch`) in a closure,
    `wrap_handle_tensordesc`'s `inner`: on every call, for every descriptor argument, `make_tensordesc_arg`
    encodes a CUtensorMap (cuTensorMapEncodeTiled) from the base address, shape, strides and block, and the
    closure calls the raw launcher with the map, the shape and the strides in the descriptor's place. In a
    plan all of those but the address are fixed (the key), so the expansion is a function of the address:
    kept per address (a few: the caching allocator hands the same blocks back), the raw launcher is called
    with the arguments the closure would have built. `of` returns None (Triton's own path) for any other
    launcher: another release, scratch memory to allocate, a descriptor without TMA metadata."""

    __slots__ = ("raw", "head", "flat", "plain", "descs")
    CACHED = 16  # addresses kept per descriptor; past it the cache starts over

    def __init__(self, raw, head: tuple, flat: list, plain: tuple, descs: tuple):
        self.raw, self.head, self.flat, self.plain, self.descs = raw, head, flat, plain, descs

    @staticmethod
    def of(step: "Step") -> "Expanded | None":
        launcher = step.run
        inner = getattr(launcher, "launch", None)
        code = getattr(inner, "__code__", None)
        if code is None or code.co_freevars != ("launcher", "tensordesc_indices", "tensordesc_meta") \
                or inner.__qualname__ != "wrap_handle_tensordesc.<locals>.inner":
            return None
        scope = dict(zip(code.co_freevars, (c.cell_contents for c in inner.__closure__)))
        encode = inner.__globals__.get("make_tensordesc_arg")
        indices, metas = sorted(scope["tensordesc_indices"]), scope["tensordesc_meta"]
        if inner.__globals__.get("_BASE_ARGS_FORMAT_LEN") != 13 or encode is None \
                or any(m is None for m in metas) or len(metas) != len(indices) \
                or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
            return None
        desc_slots = {i: (name, desc) for i, name, desc in step.slots if desc is not None}
        if set(desc_slots) != set(indices):
            return None  # a descriptor the plan does not fill (Plan.build refuses those) or a plain tensor
        flat, where, descs = [], {}, []
        for i, x in enumerate(step.template):
            where[i] = len(flat)
            if i in desc_slots:
                name, desc = desc_slots[i]
                width = 1 + len(desc.shape) + len(desc.strides)
                descs.append((len(flat), len(flat) + width, name, desc, metas[indices.index(i)], encode, {}))
                flat.extend([None] * width)
            else:
                flat.append(x)
        plain = tuple((where[i], name) for i, name, desc in step.slots if desc is None)
        head = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, step.packed, None, None, None)
        return Expanded(scope["launcher"], head, flat, plain, tuple(descs))

    def __call__(self, grid: tuple, stream, function, env: dict) -> None:
        args = self.flat.copy()
        for at, name in self.plain:
            args[at] = env[name].data_ptr()
        for start, stop, name, desc, meta, encode, cache in self.descs:
            t = env[name]
            address = t.data_ptr()
            expansion = cache.get(address)
            if expansion is None:
                if len(cache) >= self.CACHED:
                    cache.clear()
                expansion = encode(_rebase(desc, t), meta)
                if len(expansion) != stop - start:  # a Triton whose expansion differs: never launch shifted
                    raise RuntimeError(f"tensor descriptor expanded to {len(expansion)} arguments, not {stop - start}")
                cache[address] = expansion
            args[start:stop] = expansion
        self.raw(*grid, stream, function, *self.head, *args)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: None, or (triton 3.6 and 3.9) an empty HookChain, is not."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _compiled(kernel) -> bool:
    """A CompiledKernel ready to launch (its handles loaded by the normal launch)."""
    return kernel is not None and getattr(kernel, "function", None) is not None \
        and hasattr(kernel, "packed_metadata") and hasattr(kernel, "launch_metadata")


class Plan:
    """A recorded call made replayable: `run(inputs)` allocates what the call allocated and launches what it
    launched on the new tensors; `outputs`: (name, view shape or None) of what the call returned."""

    def __init__(self, steps: list, allocs: list, outputs: list, ran: dict, device_index, scratch: bool):
        self.steps, self.allocs, self.outputs, self.ran = steps, allocs, outputs, ran
        self.device_index, self.scratch = device_index, scratch
        self.direct = any(step.direct for step in steps)
        self.precompiled = False  # whether the backward's compiles were started for this key (flash.py)

    @staticmethod
    def build(rec: Recording, inputs: dict, returned: tuple, ran: dict):
        """A Plan from a recorded call (`inputs` by name as the call got them, `returned` its tensors), or
        NORMAL where it cannot be replayed exactly."""
        if not rec.replayable or not rec.steps:
            return NORMAL
        env = dict(inputs)
        for name, (t, *_rest) in rec.allocs.items():
            if name in env:
                return NORMAL
            env[name] = t
        if any(t.numel() == 0 for t in env.values()):
            return NORMAL  # empty tensors share address 0: their names could not be told apart
        direct = not INTERPRET
        steps = []
        for recorded in rec.steps:
            if recorded[0] == "copy":  # later launches read the copy
                _tag, name, t = recorded
                if name not in env:
                    return NORMAL
                env[name] = t
                steps.append(Copy(name, tuple(t.shape)))
                continue
            fn, kernel, grid, args, kwargs, names = recorded
            if hasattr(kernel, "result"):  # a compile future (triton 3.6's async compile)
                kernel = kernel.result()
            if direct and not _compiled(kernel):
                return NORMAL
            values, options = _bound(fn, args, kwargs)
            slots = []
            for i, name in enumerate(names):
                if name is None:
                    continue
                x = values[i]
                desc = x if _is_descriptor(x) else None
                t = x.base if desc is not None else x
                if name not in env or not isinstance(t, torch.Tensor) or t.data_ptr() != env[name].data_ptr():
                    return NORMAL  # a copy or a view elsewhere: not the call's tensor
                slots.append((i, name, None if desc is None else _rebase(desc, None)))  # no tensor kept
                values[i] = None
            if any(isinstance(x, torch.Tensor) or _is_descriptor(x) for x in values):
                return NORMAL  # a tensor nobody named would be pinned in the plan
            g = grid(dict(zip((n for n, _ in _params(fn)), _bound(fn, args, kwargs)[0]))) if callable(grid) else grid
            g = tuple(g) + (1,) * (3 - len(g))
            steps.append(Step(fn, kernel, g, values, tuple(slots), options, direct))
        outputs = []
        for t in returned:
            name = next((n for n, (a, *_r) in rec.allocs.items() if a.data_ptr() == t.data_ptr()), None)
            if name is None or not t.is_contiguous() or t.numel() != env[name].numel():
                return NORMAL  # not an allocation as made (a cast, a copy)
            outputs.append((name, None if t.shape == env[name].shape else tuple(t.shape)))
        allocs = [(name, shape, dtype, device, _like(inputs, t))
                  for name, (t, shape, dtype, device) in rec.allocs.items()]
        device = next(iter(inputs.values())).device
        scratch = direct and any(getattr(s.kernel.metadata, "global_scratch_size", 0) > 0
                                 for s in steps if type(s) is Step)
        return Plan(steps, allocs, outputs, dict(ran), device.index if device.type == "cuda" else None, scratch)

    def run(self, inputs: dict) -> list | None:
        """The recorded call on new inputs: its returned tensors; None where the current CUDA device is not
        the plan's (the caller takes the normal path, which switches devices)."""
        if self.device_index is not None and torch.cuda.current_device() != self.device_index:
            return None
        env = inputs
        for name, shape, dtype, device, like in self.allocs:
            env[name] = torch.empty_like(env[like]) if like else torch.empty(shape, dtype=dtype, device=device)
        if self.direct:
            stream = _driver.active.get_current_stream(self.device_index)
            enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
            hooked = _hooked(enter) or _hooked(leave)  # a launch hook (a profiler's) may read the tensors
            if not hooked:  # Triton's empty chains: the launcher skips None hooks (and needs no metadata)
                enter = leave = None
        for step in self.steps:
            if type(step) is Copy:
                step.apply(env)
                continue
            if step.expand is not None and not hooked:
                step.expand(step.grid, stream, step.function, env)
            elif step.direct:  # as JITFunction.run launches a kernel it found in its cache
                args = step.args(env, not hooked)
                g0, g1, g2 = step.grid
                meta = step.kernel.launch_metadata(step.grid, stream, *args) if hooked else None
                step.run(g0, g1, g2, stream, step.function, step.packed, meta, enter, leave, *args)
            else:  # the interpreter: the same arguments through Triton's own launch
                step.fn[step.grid](*step.args(env), **step.options)
        return [env[name] if view is None else env[name].view(view) for name, view in self.outputs]

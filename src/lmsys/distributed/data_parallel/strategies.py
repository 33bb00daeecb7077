"""Distributed strategies by name: lmsys's own, torch's, a CS336 adapters module's, and import paths.

Torch-free at import (the CLI lists and validates names before torch loads); each strategy's functions
import torch when they run. A `Strategy` says how to wrap a model, which optimizer it trains with, the
hooks around a step (before it; after backward), and how to read back full parameters (and, for the
ones that keep whole gradients, the gradients) for parity. `pkg.module:Class` is a DDP-style wrapper:
`Class(module)` or `Class(module, bucket_size_mb=...)`, with `finish_gradient_synchronization()` and,
if it has one, `on_train_batch_start()`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

from lmsys.core.errors import LmsysError
from lmsys.core.imports import call_user, load_module, load_object
from lmsys.core.registry import Registry, Spec
from lmsys.train.optim import ADAMW_DEFAULTS, DDP_TRAIN_LR

# what `ddp train --lever` adds on top of a strategy's first row (Strategy.levers: the bucketed one's)
BUCKET_LEVERS = ("learned-order", "grad-views", "bucket-optimizer", "copy-engine")


@dataclass(frozen=True)
class Strategy(Spec):
    wrap: Callable  # wrap(model, spec, ctx, *, dtype) -> the wrapped model
    bucketed: bool = False  # one row per --bucket-mb
    shards_params: bool = False  # the optimizer sees shards: no ZeRO-1 on top, no whole gradients to check
    shards_optimizer: bool = False  # its optimizer keeps a shard of the state per rank (ZeRO-1)
    adapters: bool = False  # needs --adapters
    optimizer: Optional[Callable] = None  # (wrapped, spec) -> optimizer; None: AdamW (ZeRO-1 if asked)
    optimizer_label: str = "AdamW"
    hooks: Optional[Callable] = None  # (wrapped, optimizer, spec) -> (before, after_backward); None: methods
    full_params: Optional[Callable] = None  # (wrapped, spec) -> {name: tensor}; None: the module's own
    origin: str = "lmsys"  # lmsys | torch | yours (the adapters' or an import path's)
    levers: tuple[str, ...] = ()  # `ddp train --lever`s it takes, each a row on its first cap and comm dtype
    lever_optimizer: Optional[Callable] = None  # (wrapped, spec) -> the optimizer a lever brings, or None
    first_cap_only: bool = False  # with buckets, but one row at the first --bucket-mb (yours-zero1)
    mesh_dp: bool = False  # `parallel train --dp-strategy` takes it (the dp dimension of a mesh)
    note: str = ""  # the line under a `ddp train` table that has its row

    @property
    def hand_written(self) -> bool:
        """lmsys's own wrapper (not torch's, not a user's)."""
        return self.origin == "lmsys"


def _from_path(name: str) -> Strategy:
    cls = load_object(name, what="--strategy")
    if not callable(cls):
        raise LmsysError(f"--strategy {name}: {type(cls).__name__} is not a class or a callable")
    try:
        takes_bucket = "bucket_size_mb" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        takes_bucket = False

    def wrap(model, spec, ctx, *, dtype):
        return cls(model, bucket_size_mb=spec.bucket_mb) if takes_bucket else cls(model)

    return Strategy(name, "your wrapper", wrap, bucketed=takes_bucket, origin="yours")


STRATEGIES: Registry[Strategy] = Registry(
    "distributed strategy", option="--strategy", path_form="pkg.module:Class", from_path=_from_path,
    path_help="your DDP-style wrapper: Class(module) or Class(module, bucket_size_mb=...), "
              "finish_gradient_synchronization(), optional on_train_batch_start()")


def register(name: str, help: str, **kw):
    """`@register("naive", "one line")` on wrap(model, spec, ctx, *, dtype)."""
    def add(wrap):
        STRATEGIES.add(Strategy(name, help, wrap, **kw))
        return wrap
    return add


def listing() -> list[tuple[str, str]]:
    return STRATEGIES.listing(label=lambda s: s.help + (" (--adapters)" if s.adapters else ""))


def check_name(name: str, *, adapters: Optional[str] = None) -> str:
    STRATEGIES.check(name)
    if name in STRATEGIES and STRATEGIES[name].adapters and adapters is None:
        raise LmsysError(f"--strategy {name} runs your adapters' code: add --adapters PATH "
                         "(a .py file or a module name)")
    return name


def get(name: str) -> Strategy:
    """The strategy for a registered name, or one made for an import path (the class is loaded now)."""
    return STRATEGIES.lookup(name)


def adapters_module(spec):
    return load_module(spec.adapters, what="--adapters")


# ----------------------------------------------------------------------------- lmsys's and torch's


@register("naive", "lmsys NaiveDDP: one all-reduce per parameter after backward")
def _naive(model, spec, ctx, *, dtype):
    from lmsys.distributed.data_parallel.ddp import NaiveDDP

    return NaiveDDP(model)


@register("flat", "lmsys FlatDDP: one all-reduce of all gradients flattened")
def _flat(model, spec, ctx, *, dtype):
    from lmsys.distributed.data_parallel.ddp import FlatDDP

    return FlatDDP(model)


@register("overlap", "lmsys OverlapDDP: an async all-reduce per parameter as its gradient is ready")
def _overlap(model, spec, ctx, *, dtype):
    from lmsys.distributed.data_parallel.ddp import OverlapDDP

    return OverlapDDP(model)


def _bucketed_optimizer(wrapped, spec):
    from lmsys.distributed.data_parallel.ddp import StepInFinish

    return StepInFinish(wrapped) if spec.lever == "bucket-optimizer" else None


@register("bucketed", "lmsys BucketedDDP: gradients in --bucket-mb buckets, each all-reduced when full",
          bucketed=True, levers=BUCKET_LEVERS, lever_optimizer=_bucketed_optimizer, mesh_dp=True)
def _bucketed(model, spec, ctx, *, dtype):
    from lmsys.core.devices import torch_dtype
    from lmsys.distributed.data_parallel import ddp
    from lmsys.train.optim import make_optimizer

    comm = None if spec.comm_dtype == "fp32" else torch_dtype(spec.comm_dtype)
    factory = None
    if spec.lever == "bucket-optimizer":
        # the same (foreach) AdamW as every other row: a fused one per bucket measured 163 ms against
        # 190 on 2xH200, most of it fused against foreach, not overlap
        factory = partial(make_optimizer, lr=DDP_TRAIN_LR)
    return ddp.BucketedDDP(model, spec.bucket_mb, comm_dtype=comm, optimizer_factory=factory,
                           bucket_order="learned" if spec.lever == "learned-order" else "reverse",
                           grad_views=spec.lever == "grad-views", sm_carveout=spec.sm_carveout,
                           copy_engine=spec.lever == "copy-engine")


@register("torch-ddp", "torch.nn.parallel.DistributedDataParallel (25 MiB buckets)", origin="torch", mesh_dp=True,
          note="torch.nn.parallel.DistributedDataParallel with its defaults (25 MiB buckets).")
def _torch_ddp(model, spec, ctx, *, dtype):
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def _lmsys_fsdp_params(wrapped, spec):
    return wrapped.gather_full_params()


@register("fsdp", "lmsys FSDP: parameters sharded, gathered per layer", shards_params=True,
          optimizer_label="AdamW on shards", full_params=_lmsys_fsdp_params, mesh_dp=True)
def _fsdp(model, spec, ctx, *, dtype):
    from lmsys.core.devices import torch_dtype
    from lmsys.distributed.data_parallel.fsdp import FSDP

    return FSDP(model, compute_dtype=None if dtype == "fp32" else torch_dtype(dtype))


def _dtensor_params(wrapped, spec):  # DTensors: full_tensor() all-gathers each
    return {name: p.full_tensor().detach() for name, p in wrapped.named_parameters()}


@register("torch-fsdp", "torch FSDP2 fully_shard on each block and the root", shards_params=True,
          optimizer_label="AdamW on shards", full_params=_dtensor_params, origin="torch", mesh_dp=True,
          note="torch's FSDP2 fully_shard on each block and the root, parameters in the autocast dtype, "
               "gradients reduced in fp32.")
def _torch_fsdp(model, spec, ctx, *, dtype):
    return torch_fully_shard(model, ctx, dtype=dtype)


def torch_fully_shard(model, ctx, *, dtype: str):
    """torch's FSDP2: fully_shard on each block, then on the root, parameters in the compute dtype
    (bf16 with --dtype bf16) and gradients reduced in fp32. Needs torch >= 2.6. Blocks: the model's
    largest list of identical modules (lmsys.model.user.find_blocks)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lmsys.core.devices import torch_dtype
    from lmsys.distributed.data_parallel.ddp import broadcast_module_state
    from lmsys.model.user import find_blocks

    broadcast_module_state(model)  # as every other strategy: rank 0's weights
    param_dtype = None if dtype == "fp32" else torch_dtype(dtype)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in find_blocks(model) or []:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


# ----------------------------------------------------------------------------- a CS336 adapters module


def _adapter_hooks(before: tuple[str, ...], after: tuple[str, ...]):
    """Hooks calling the adapters' fn(model, optimizer); the wrapper's own methods where they are absent."""
    def hooks(wrapped, optimizer, spec):
        module = adapters_module(spec)

        def hook(names, method):
            if any(hasattr(module, n) for n in names):
                return lambda: call_user(module, names, wrapped, optimizer)
            return getattr(wrapped, method, None)

        return (hook(before, "on_train_batch_start") if before else getattr(wrapped, "on_train_batch_start", None),
                hook(after, "finish_gradient_synchronization"))
    return hooks


@register("yours", "your get_ddp(module) (or get_ddp_individual_parameters) and its on_after_backward",
          adapters=True, origin="yours", hooks=_adapter_hooks((), ("ddp_on_after_backward",
                                                   "ddp_individual_parameters_on_after_backward")))
def _yours(model, spec, ctx, *, dtype):
    return call_user(adapters_module(spec), ("get_ddp", "get_ddp_individual_parameters"), model)


@register("yours-bucketed", "your get_ddp_bucketed(module, bucket_size_mb), one row per --bucket-mb",
          adapters=True, bucketed=True, origin="yours",
          hooks=_adapter_hooks(("ddp_bucketed_on_train_batch_start",), ("ddp_bucketed_on_after_backward",)))
def _yours_bucketed(model, spec, ctx, *, dtype):
    return call_user(adapters_module(spec), ("get_ddp_bucketed",), model, spec.bucket_mb)


def _yours_fsdp_params(wrapped, spec):
    params = call_user(adapters_module(spec), ("fsdp_gather_full_params",), wrapped)
    return {name.removeprefix("module."): t for name, t in params.items()}


@register("yours-fsdp", "your get_fsdp(module, compute_dtype) with --dtype's compute dtype; parity through "
          "your fsdp_gather_full_params", adapters=True, origin="yours", shards_params=True,
          optimizer_label="AdamW on shards",
          hooks=_adapter_hooks((), ("fsdp_on_after_backward",)), full_params=_yours_fsdp_params)
def _yours_fsdp(model, spec, ctx, *, dtype):
    from lmsys.core.devices import torch_dtype

    compute = None if dtype == "fp32" else torch_dtype(dtype)
    return call_user(adapters_module(spec), ("get_fsdp",), model, compute)


def _yours_sharded_optimizer(wrapped, spec):
    import torch

    return call_user(adapters_module(spec), ("get_sharded_optimizer",), wrapped.parameters(), torch.optim.AdamW,
                     lr=DDP_TRAIN_LR, **ADAMW_DEFAULTS)


@register("yours-zero1", "lmsys's bucketed DDP (first --bucket-mb) with your get_sharded_optimizer(params, "
          "AdamW, ...): parity and optimizer state per rank against plain AdamW", adapters=True,
          origin="yours", optimizer=_yours_sharded_optimizer, optimizer_label="your sharded AdamW",
          shards_optimizer=True, first_cap_only=True)
def _yours_zero1(model, spec, ctx, *, dtype):
    from lmsys.distributed.data_parallel.ddp import BucketedDDP

    return BucketedDDP(model, spec.bucket_mb)


# ----------------------------------------------------------------------------- what a run uses


def make_strategy_optimizer(wrapped, spec, *, sharded: bool):
    """The strategy's optimizer: its own (the bucket-optimizer lever's per-bucket AdamWs, a user's
    sharded optimizer), else AdamW, ZeRO-1 sharded when asked."""
    import torch

    from lmsys.train.optim import make_optimizer

    strategy = get(spec.strategy)
    own = strategy.optimizer(wrapped, spec) if strategy.optimizer else None
    if own is None and strategy.lever_optimizer is not None:
        own = strategy.lever_optimizer(wrapped, spec)
    if own is not None:
        return own
    if sharded:  # ZeRO-1 over the same AdamW (train.step sits below distributed: it does not know it)
        from lmsys.distributed.data_parallel.zero1 import ShardedOptimizer

        return ShardedOptimizer(wrapped.parameters(), torch.optim.AdamW, lr=DDP_TRAIN_LR, **ADAMW_DEFAULTS)
    return make_optimizer(wrapped.parameters(), lr=DDP_TRAIN_LR)


def optimizer_label(spec, *, sharded: bool) -> str:
    strategy = get(spec.strategy)
    if sharded:
        return "AdamW, ZeRO-1 sharded"
    if spec.lever == "bucket-optimizer":
        return "AdamW per bucket, in finish"
    return strategy.optimizer_label


def wrap_model(model, spec, ctx, *, dtype: str):
    return get(spec.strategy).wrap(model, spec, ctx, dtype=dtype)


def step_hooks(wrapped, optimizer, spec) -> tuple[Optional[Callable], Optional[Callable]]:
    """(before each step, after each backward)."""
    strategy = get(spec.strategy)
    if strategy.hooks is not None:
        return strategy.hooks(wrapped, optimizer, spec)
    return getattr(wrapped, "on_train_batch_start", None), getattr(wrapped, "finish_gradient_synchronization", None)


def inner_module(wrapped):
    """The model a DDP-style wrapper holds (`.module`), or the wrapper itself."""
    return getattr(wrapped, "module", wrapped)


def final_parameters(wrapped, spec) -> dict:
    """Full parameters by the model's names (sharded strategies gather them: a collective on every rank)."""
    strategy = get(spec.strategy)
    if strategy.full_params is not None:
        return strategy.full_params(wrapped, spec)
    return {name: p.detach() for name, p in inner_module(wrapped).named_parameters()}


def gradients(wrapped, spec) -> Optional[dict]:
    """Whole gradients by the model's names, or None where a strategy keeps only shards of them (or the
    bucket-optimizer lever has stepped and freed them)."""
    if get(spec.strategy).shards_params or spec.lever == "bucket-optimizer":
        return None
    return {name: p.grad for name, p in inner_module(wrapped).named_parameters()}


# --dp-strategy of a mesh: the strategies its dp dimension takes (Strategy.mesh_dp), lmsys's before torch's.
# Here, torch-free, so that parallel train checks the option before torch loads.
MESH_DP = tuple(sorted(STRATEGIES.names(lambda s: s.mesh_dp), key=lambda n: not STRATEGIES[n].hand_written))
HAND_WRITTEN_DP = tuple(n for n in MESH_DP if STRATEGIES[n].hand_written)  # torch-* run torch's wrappers

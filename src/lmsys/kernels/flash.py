"""FlashAttention-2 as callers run it: the `Policy` that says how, the one dispatcher between
lmsys.kernels.flash_gluon's Hopper kernels and lmsys.kernels.flash_triton's tl kernels, the backward's
kernels compiled during the first forward (lmsys.kernels.precompile), the autograd function
`FlashAttentionTriton` and the custom ops that torch.compile traces. The kernels, their configs, the tuner
and the tl launchers are in flash_triton; how it all works and where each `Policy` default comes from:
docs/kernels.md.

Inputs: q [..., Hq, n_q, d], k and v [..., Hkv, n_k, d] with Hq a multiple of Hkv; the limits of head dim,
dtype and device are flash_triton's (its module docstring). `launch_forward` / `launch_backward` check
them, run what the policy and the inputs choose, and return what ran. LMSYS_FLASH_AUTOTUNE=0 makes the
default policy take the first config that fits instead of tuning.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, fields, replace

import torch

from lmsys.core.errors import LmsysError
from lmsys.core.flops import attention_flops
from lmsys.kernels import flash_triton as ft  # names read at each call: patching INTERPRET, CONFIGS... there holds
from lmsys.kernels import plans, precompile, tuning
from lmsys.kernels.dots import dot_precision
from lmsys.kernels.shapes import check_qkv

# ------------------------------------------------------------------------------------------ policy


@dataclass(frozen=True)
class Policy:
    """How the launchers run the kernels; frozen (change a lever with dataclasses.replace). The autograd
    function and `launch_forward` / `launch_backward` take one; `default_policy()` is what users run.

    pick: None = lmsys's tuner over flash_triton.CONFIGS, FP32_CONFIGS for fp32 (`flash_triton._tuned`: at
      most two fitting configs timed once per shape class, the choice kept in memory and on disk); an int
      i = untimed, the i-th (modulo their number) of the configs that fit, for each kernel.
    configs: ((kernel, (Config, ...)), ...) that `pick` chooses from instead of those lists (needs
      a pick); a dict {kernel: [Config, ...]} is accepted and stored as such pairs.
    wide_configs: `pick` chooses from flash_triton.WIDE_CONFIGS followed by the list above (needs a pick).
    deterministic: None = the fastest measured for the shape: with `gluon` on, the Gluon one-launch
      backward where `flash_gluon.usable_backward` takes the inputs (Hopper, flash_gluon.HEAD_DIMS; strided
      views copied) and there are at least `gluon_bwd_min_keys` keys (not bitwise reproducible), the two
      atomics-free kernels elsewhere, but for fp32 inputs at head dims 64 to 128 the tl one launch with
      atomics (see False) unless the call is host-bound; True = the two atomics-free kernels always
      (bitwise reproducible); False = one launch that also accumulates dQ in float32 with atomics (the
      Gluon one wherever it runs when `gluon` is on, the tl one elsewhere).
    tma: the forward loads Q, K, V through tensor descriptors where they can run (triton with
      tl.make_tensor_descriptor, CUDA compute capability >= 9 or the interpreter, 16-byte aligned strides).
    tma_backward: the backward's streamed loads (Qᵀ and dO in the dK/dV kernel, Kᵀ and Vᵀ in the dQ
      kernel) through tensor descriptors, where `tma` could run them.
    tma_reduce_dq: with deterministic=False and descriptors in the backward, dQ is added by TMA reduce-adds
      on a GPU (element-wise atomics otherwise, and always under the interpreter).
    warp_specialize: the forward's key loop as tl.range(..., warp_specialize=True), with the 8-warp
      configs only (flash_triton.WARP_SPEC_MIN_WARPS; off where none fits).
    warp_spec_with_tma: keep warp_specialize on where the forward's descriptors run (off: `tma` wins).
    gluon: the forward runs lmsys.kernels.flash_gluon where `flash_gluon.usable` takes the inputs (Hopper,
      bf16/fp16, d 16/32/64/128 (below 64 from `gluon_small_min_keys` keys), n_q == n_k a multiple of its
      tiles, contiguous, or strided and copied from
      `gluon_copy_min_keys` keys); the tl forward elsewhere. Where it runs, the tl forward's levers (tma,
      warp_specialize, persistent, and pick/configs for "fwd") do not apply. The Gluon one-launch backward
      runs there too: from `gluon_bwd_min_keys` keys with deterministic=None, at any length with False,
      never with True.
    gluon_bwd_min_keys: see deterministic.
    gluon_copy_min_keys: ((head dim, keys), ...): from how many keys the forward copies strided q, k, v
      for the Gluon forward at that head dim (never at head dims not listed).
    persistent: the forward launches min(#SMs, #tiles) programs (4 under the interpreter), each looping over
      (query tile, batch·head) work items, causal ones heaviest first across all heads.
    gluon_small_min_keys: ((causal, keys), ...): at head dims below 64 (16, 32) the Gluon kernels, forward
      and backward, run only from that many keys (measured on an H100 against the tl kernels: not causal
      faster from 8,192, causal from 16,384); d 64 and 128 are not limited by it.
    host_bound_flops: a call whose forward is at most this many FLOPs (4·Z·H·n_q·n_k·d; 2³³: 8 × 1 × 2,048
      keys at d 64, 1,024 at d 128 and 256, some 30 µs of kernels) is host-bound: it runs the tl kernels
      without tensor descriptors, the launches that cost the host least (no descriptor to encode, no
      scratch to allocate), whatever `gluon`, `tma` and `tma_backward` say. 0: never.
    fused_backward: the tl atomics-free backward as one launch, the dK/dV kernel's programs followed by the
      dQ kernel's (each computing the D it needs): one launch and one allocation fewer, the same work, still
      bitwise reproducible. None = in host-bound calls only; True = wherever that backward runs; False = never.
    heads_fast: causal grids with batch·heads first and the tiles last, so that every head's heaviest tile
      starts before any head's next (the tl kernels, but for the fused backward of host-bound calls and
      past flash_triton.MAX_FAST_ROWS keys; the Gluon backward, and its forward up to
      flash_gluon.FWD_HEADS_FAST_WAVES programs an SM); False: one head's tiles after another's.
    """

    pick: int | None = None
    configs: tuple | None = None
    deterministic: bool | None = None
    tma: bool = False
    tma_backward: bool = False
    warp_specialize: bool = False
    gluon: bool = False
    persistent: bool = False
    gluon_bwd_min_keys: int = 4096
    gluon_copy_min_keys: tuple = ((128, 16384),)
    tma_reduce_dq: bool = True
    warp_spec_with_tma: bool = False
    wide_configs: bool = False
    gluon_small_min_keys: tuple = ((False, 8192), (True, 16384))
    host_bound_flops: int = 2 ** 33
    fused_backward: bool | None = None
    heads_fast: bool = True

    def __post_init__(self):
        # dicts and lists kept as hashable pairs
        for name in ("configs", "gluon_copy_min_keys", "gluon_small_min_keys"):
            value = getattr(self, name)
            if isinstance(value, dict):
                value = value.items()
            if value is not None and not isinstance(value, tuple):
                value = tuple(value)
            if value is not None:
                value = tuple((key, tuple(v) if isinstance(v, list) else v) for key, v in value)
            object.__setattr__(self, name, value)
        # hashed once: a policy is part of every call's plan key (lmsys.kernels.plans)
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self):
        return self._hash

    def __getstate__(self):  # the hash is this process's (strings hash apart in each): not pickled
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def configs_for(self, kernel: str, dtype=None) -> list:
        """The configs `pick` chooses from for `kernel` at `dtype` (flash_triton.base_configs: fp32's own)."""
        if self.configs is not None:
            return list(dict(self.configs)[kernel])
        base = ft.base_configs(kernel, dtype)
        return ft.WIDE_CONFIGS[kernel] + base if self.wide_configs else base

    def gluon_copy_from(self, d: int) -> float:
        """From how many keys strided inputs at head dim d are copied for the Gluon forward (inf: never)."""
        return dict(self.gluon_copy_min_keys).get(d, math.inf)

    def gluon_from(self, d: int, is_causal: bool) -> float:
        """From how many keys the Gluon kernels may run at head dim d (0: any; d < 64: gluon_small_min_keys)."""
        return 0 if d >= 64 else dict(self.gluon_small_min_keys).get(bool(is_causal), math.inf)


DEFAULT_POLICY = Policy(tma_backward=True, gluon=True)

Ran = dict  # what a launch ran: kernel ("fwd", "dq", "dkdv", "dkdv+dq" fused, "bwd" the Gluon one launch) -> tiles


def default_policy() -> Policy:
    """DEFAULT_POLICY, taking the first config that fits instead of autotuning when LMSYS_FLASH_AUTOTUNE=0."""
    if os.environ.get("LMSYS_FLASH_AUTOTUNE") == "0":
        return _first_fit(DEFAULT_POLICY)
    return DEFAULT_POLICY


@functools.lru_cache(maxsize=8)
def _first_fit(policy: Policy) -> Policy:
    return replace(policy, pick=0)  # cached: replace costs µs on every attention call


@functools.lru_cache(maxsize=8)
def _host_bound(policy: Policy) -> Policy:
    """`policy` for a host-bound call (Policy.host_bound_flops): no tensor descriptors, the backward fused
    unless the policy says never."""
    return replace(policy, tma=False, tma_backward=False, fused_backward=policy.fused_backward is not False)


FP32_ATOMIC_HEAD_DIMS = (64, 128)  # where _fp32_backward was measured faster (d 16: +16 %, d 32: a tie)


@functools.lru_cache(maxsize=8)
def _fp32_backward(policy: Policy) -> Policy:
    """`policy` for an fp32 backward that is not host-bound with deterministic=None: the tl one launch with
    dQ by atomics. With fp32's six bf16 products a dot, its five dots a tile beat the two kernels' seven
    (S and dP computed twice): −11 to −14 % at d 64 and 128, 4,096 and 8,192 keys on an H200
    (docs/benchmarks/attention-h200-fused-fp32.md)."""
    return replace(policy, deterministic=False)


# ------------------------------------------------------------------------------------------ inputs


def check_device(device) -> None:
    """CUDA, or any device when Triton's interpreter is on; otherwise point at flash-torch."""
    if torch.device(device).type != "cuda" and not ft.INTERPRET:
        raise LmsysError(
            f"flash-triton needs CUDA tensors (got {torch.device(device).type}); use flash-torch on a CPU",
            hint="or set TRITON_INTERPRET=1 before lmsys is imported to run the Triton kernels in its interpreter",
        )


def check_head_dim(d: int) -> None:
    """The head dims the kernels take: multiples of 8 from 16 to 256 (fp32 narrows them: _check_inputs)."""
    if d not in ft.HEAD_DIMS:
        raise LmsysError(f"flash-triton: head dim {d} is not supported (supported: multiples of "
                         f"{ft.HEAD_DIM_STEP} from {ft.MIN_HEAD_DIM} to {ft.MAX_HEAD_DIM})",
                         hint="use flash-torch or sdpa for other head dims")


@functools.lru_cache(maxsize=None)
def _smallest_tiles(d_pad: int, dtype) -> dict:
    """Shared-memory bytes of each kernel's cheapest config at `dtype` (cached: checked on every call)."""
    return {kernel: min(ft._cost(kernel, c, d_pad, dtype.itemsize)[1] for c in ft.base_configs(kernel, dtype))
            for kernel in ft.CONFIGS}


def _check_shared_memory(d: int, dtype, device) -> None:
    """Every kernel has a config whose tiles fit in this GPU's shared memory (read from the device)."""
    smem = ft.shared_memory(device)
    if smem is None:
        return
    for kernel, need in _smallest_tiles(ft.head_dim_pad(d), dtype).items():
        if need > smem:
            raise LmsysError(f"flash-triton: head dim {d} in {dtype} needs {need} bytes of shared memory per "
                             f"block ({kernel} kernel, smallest tile); this GPU offers {smem}",
                             hint="use bf16 or fp16, a smaller head dim, or flash-torch / sdpa")


def _check_inputs(q, k, v) -> None:
    # shape constraints
    check_qkv(q, k, v, impl="flash-triton")
    d = q.shape[-1]
    check_head_dim(d)
    if q.dtype not in ft.DTYPES:
        raise LmsysError(f"flash-triton: dtype {q.dtype} is not supported (float32, float16, bfloat16)")
    if q.dtype == torch.float32 and d > ft.FP32_MAX_HEAD_DIM:
        raise LmsysError(f"flash-triton: head dim {d} needs fp16 or bf16 inputs (in fp32 its tiles do not fit "
                         f"in shared memory; fp32 supports head dims up to {ft.FP32_MAX_HEAD_DIM})",
                         hint="cast to bf16, or use flash-torch or sdpa")
    check_device(q.device)
    _check_shared_memory(d, q.dtype, q.device)


def _as_4d(x: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """[..., h, n, d] -> [Z, h, n, d] with unit stride along d: a view when the strides allow it, else a
    copy (through plans.contiguous for the call's tensor `name`, which a launch plan replays)."""
    if x.dim() == 2:
        x = x[None, None]
    elif x.dim() == 3:
        x = x[None]
    elif x.dim() > 4:
        x = x.reshape(-1, *x.shape[-3:])
    if x.stride(-1) != 1:
        x = plans.contiguous(name, x) if name else x.contiguous()
    return x


# ---------------------------------------------------------------------------------------- dispatch


@functools.lru_cache(maxsize=None)
def _gluon():
    """lmsys.kernels.flash_gluon, or None where this triton has no Gluon for Hopper, is not the release
    the kernel was written for (flash_gluon.TRITON_RELEASES), or runs the interpreter (no Gluon there)."""
    if ft.INTERPRET:
        return None
    try:
        from lmsys.kernels import flash_gluon
    except (ImportError, AttributeError):
        return None
    return flash_gluon if flash_gluon.available() else None


def _gluon_forward(gluon, q4, k4, v4, is_causal: bool, heads_fast: bool):
    """flash_gluon's forward on inputs it took: (o4, lse, what ran)."""
    Z, H, n_q, d = q4.shape
    o4 = plans.alloc("o", (Z, H, n_q, d), q4.dtype, q4.device)
    lse = plans.alloc("lse", (Z, H, n_q), torch.float32, q4.device)
    with ft._device_guard(q4.device):
        tiles = gluon.forward(q4, k4, v4, o4, lse, is_causal, heads_fast=heads_fast)
    return o4, lse, {"fwd": tiles}


def _gluon_backward(gluon, q4, k4, v4, o4, lse3, do4, is_causal: bool, heads_fast: bool, prepare: list | None = None):
    """flash_gluon's one-launch backward on (contiguous) inputs it took: D first, then the kernel adds into a
    zeroed float32 dQ that it casts into q's dtype. (dq4, dk4, dv4, what ran); with `prepare` (see
    flash_triton._launch) None, the compiles appended."""
    Z, H, n_q, d = q4.shape
    H_kv, n_k = k4.shape[1], k4.shape[2]
    dq32 = plans.alloc("dq32", (Z, H, n_q, d), torch.float32, q4.device)  # zeroed by the preprocess
    dq = plans.alloc("dq", tuple(q4.shape), q4.dtype, q4.device)
    dk4 = plans.alloc("dk", (Z, H_kv, n_k, d), k4.dtype, q4.device)
    dv4 = plans.alloc("dv", (Z, H_kv, n_k, d), v4.dtype, q4.device)
    with ft._device_guard(q4.device):
        delta = ft._preprocess(o4, do4, dq32, "dq32", prepare)
        tiles = gluon.backward(q4, k4, v4, do4, lse3, delta, dq32, dq, dk4, dv4, is_causal, prepare=prepare,
                               heads_fast=heads_fast)
    return None if prepare is not None else (dq, dk4, dv4, {"bwd": tiles})


def _dispatch(direction: str, policy: Policy, is_causal: bool, q4, k4, v4, o4=None, lse3=None, do4=None,
              prepare: list | None = None):
    """The one place that chooses between flash_gluon's kernels and the tl ones, and runs them on [Z, H, n, d]
    inputs: ("fwd") (o4, lse, ran) or ("bwd") (dq4, dk4, dv4, ran). Gluon runs only where `policy.gluon` is
    on and flash_gluon runs here (Hopper, its triton release); then the forward where `usable` takes the
    inputs, strided views copied first from `policy.gluon_copy_min_keys` keys (TMA reads [rows, d] tiles:
    the copies cost less than the Gluon forward saves only there), and the one-launch backward where
    deterministic is False, or None with at least `policy.gluon_bwd_min_keys` keys, on contiguous copies.
    prepare (the backward only): a list that the compiles of the kernels it would run are appended to, from
    stand-in outputs; nothing runs (see _precompile_backward). A host-bound call (`policy.host_bound_flops`)
    runs the tl kernels without descriptors."""
    Z, H, n_q, d = q4.shape
    n_k = k4.shape[2]
    if attention_flops(batch=Z, heads=H, n_queries=n_q, n_keys=n_k, d_head=d, causal=False,
                       direction="fwd") <= policy.host_bound_flops:
        gluon, policy = None, _host_bound(policy)
    else:
        gluon = _gluon() if policy.gluon and n_k >= policy.gluon_from(d, is_causal) else None
        if direction == "bwd" and policy.deterministic is None and q4.dtype == torch.float32 \
                and FP32_ATOMIC_HEAD_DIMS[0] <= d <= FP32_ATOMIC_HEAD_DIMS[1]:
            policy = _fp32_backward(policy)
    if direction == "fwd":
        if gluon is not None and n_k >= policy.gluon_copy_from(q4.shape[-1]) and not gluon.usable(q4, k4, v4) \
                and gluon.usable(q4, k4, v4, layout=False):
            q4, k4, v4 = (x.contiguous() for x in (q4, k4, v4))
        if gluon is not None and gluon.usable(q4, k4, v4):
            return _gluon_forward(gluon, q4, k4, v4, is_causal, policy.heads_fast)
        return ft._tl_forward(q4, k4, v4, is_causal, policy)
    if gluon is not None and policy.deterministic is not True \
            and (policy.deterministic is False or n_k >= policy.gluon_bwd_min_keys) \
            and gluon.usable_backward(q4, k4, v4, do4, layout=False):
        # the model's v from a split and dO from a rearrange's backward are strided: copied once, a fraction
        # of what the one launch saves at these sizes
        if prepare is None:
            copies = tuple(x.contiguous() for x in (q4, k4, v4, do4))
        else:  # what .contiguous() gives, without the copy
            copies = tuple(x if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype, device=x.device)
                           for x in (q4, k4, v4, do4))
        if gluon.usable_backward(*copies):
            cq, ck, cv, cdo = copies
            return _gluon_backward(gluon, cq, ck, cv, o4, lse3, cdo, is_causal, policy.heads_fast, prepare)
    return ft._tl_backward(q4, k4, v4, o4, lse3, do4, is_causal, policy, prepare)


# --------------------------------------------------------------------------------------- precompile


_PRECOMPILED: set = set()  # the shape classes whose backward's compiles were started


def _precompile_backward(q4, k4, v4, is_causal: bool, policy: Policy) -> None:
    """On the first forward of a shape class (shapes, dtype, device, causal, policy), start compiling the
    kernels its backward will run, in the background (lmsys.kernels.precompile): _dispatch's own choice of
    kernels and configs, from stand-ins for o, L and dO shaped as the forward makes them. Their compiles then
    overlap the forward's own; launch_backward waits for what is still in flight. A warm call: one set
    lookup."""
    key = (q4.shape, k4.shape, q4.dtype, q4.device, is_causal, policy, dot_precision(q4))
    if key in _PRECOMPILED or ft.INTERPRET or not precompile.allowed(q4.device):
        return
    _PRECOMPILED.add(key)
    try:
        Z, H, n_q, d = q4.shape
        o4 = torch.empty((Z, H, n_q, d), dtype=q4.dtype, device=q4.device)
        lse3 = torch.empty((Z, H, n_q), dtype=torch.float32, device=q4.device)
        compiles: list = []
        _dispatch("bwd", policy, is_causal, q4, k4, v4, o4=o4, lse3=lse3, do4=torch.empty_like(o4), prepare=compiles)
    except Exception:  # noqa: BLE001 - the real backward meets the error again
        return
    precompile.start(compiles, q4.device)


@functools.cache
def _first_call() -> None:
    """Once per process, before anything touches Triton's driver: the driver (cuda_utils, built with gcc on a
    cold cache) starts on a background thread while this one reads or computes Triton's own hash
    (tuning.persist_triton_key: Triton's per-process hash from disk before its first cache lookup)."""
    building = precompile.driver_in_background()
    tuning.persist_triton_key()
    if building is not None:
        try:
            building.result()
        except Exception:  # noqa: BLE001 - the real call meets the error again
            pass


# ---------------------------------------------------------------------------------------- launchers


def launch_forward(q, k, v, is_causal: bool = False, *, policy: Policy | None = None,
                   precompile_backward: bool = False, key: tuple | None = None):
    """(o [..., n_q, d] in q's dtype, L [..., n_q] float32, what ran: {"fwd": tiles}). k, v may have fewer
    heads than q (dim -3). precompile_backward: a backward will follow (see _precompile_backward).
    A call whose key (lmsys.kernels.plans: shapes, strides, dtypes, device, alignment, causal, policy) was
    seen replays that call's plan: no checks (the key passed them), two allocations, one direct launch.
    key: this call's `plans.key`, where the caller computed it (FlashAttentionTriton keeps it for the backward)."""
    policy = policy or default_policy()
    is_causal = bool(is_causal)
    if not plans.ENABLED:
        return _forward(q, k, v, is_causal, policy, precompile_backward)
    if key is None:
        key = plans.key(("fwd", is_causal, policy), (q, k, v))
    plan = plans.lookup(key)
    if plan is plans.NORMAL:
        return _forward(q, k, v, is_causal, policy, precompile_backward)
    if plan is None:  # the first call of this key: the normal path, recorded
        rec = plans.Recording()
        o, lse, ran = _forward(q, k, v, is_causal, policy, precompile_backward, rec)
        plan = plans.Plan.build(rec, {"q": q, "k": k, "v": v}, (o, lse), ran)
        if plan is not plans.NORMAL:
            plan.precompiled = precompile_backward
        plans.store(key, plan)
        return o, lse, ran
    if precompile_backward and not plan.precompiled:  # recorded without grad, now a backward follows
        _precompile_backward(_as_4d(q), _as_4d(k), _as_4d(v), is_causal, policy)
        plan.precompiled = True
    if plan.scratch:
        ft._set_tma_allocator()
    out = plan.run({"q": q, "k": k, "v": v})
    if out is None:  # another current device: the normal path switches to q's
        return _forward(q, k, v, is_causal, policy, precompile_backward)
    return out[0], out[1], dict(plan.ran)


def _forward(q, k, v, is_causal: bool, policy: Policy, precompile_backward: bool,
             rec: plans.Recording | None = None):
    """launch_forward without a plan: checks, [Z, H, n, d] views, the dispatch (recorded into `rec`)."""
    if not ft.INTERPRET:
        _first_call()
    _check_inputs(q, k, v)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    if precompile_backward:
        _precompile_backward(q4, k4, v4, is_causal, policy)
    with plans.recording(rec):
        o4, lse, ran = _dispatch("fwd", policy, is_causal, q4, k4, v4)
    return o4.view(q.shape), lse.view(q.shape[:-1]), ran


def launch_backward(q, k, v, o, lse, do, is_causal: bool = False, *, policy: Policy | None = None,
                    forward_key: tuple | None = None):
    """(dq, dk, dv in the inputs' dtypes, what ran: {"dq", "dkdv"}, {"dkdv+dq"} or {"bwd"} -> tiles), from the saved L;
    dk, dv summed over each key/value head's group of query heads. A seen key replays its plan, as
    launch_forward does. forward_key: the key of the launch_forward call whose inputs q, k, v are and whose
    outputs o, L are, with this policy and is_causal: the backward's key is then that and dO's alone (o's and
    L's shapes, strides, dtypes and alignment follow from it: `alloc`'s fresh tensors), a third of the cost."""
    policy = policy or default_policy()
    is_causal = bool(is_causal)
    if not plans.ENABLED:
        return _backward(q, k, v, o, lse, do, is_causal, policy)
    if forward_key is None:
        key = plans.key(("bwd", is_causal, policy), (q, k, v, o, lse, do))
    else:
        key = plans.key(("bwd", forward_key), (do,))
    plan = plans.lookup(key)
    if plan is plans.NORMAL:
        return _backward(q, k, v, o, lse, do, is_causal, policy)
    if plan is None:
        rec = plans.Recording()
        dq, dk, dv, ran = _backward(q, k, v, o, lse, do, is_causal, policy, rec)
        plans.store(key, plans.Plan.build(rec, {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do},
                                          (dq, dk, dv), ran))
        return dq, dk, dv, ran
    if plan.scratch:
        ft._set_tma_allocator()
    out = plan.run({"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do})
    if out is None:
        return _backward(q, k, v, o, lse, do, is_causal, policy)
    return out[0], out[1], out[2], dict(plan.ran)


def _backward(q, k, v, o, lse, do, is_causal: bool, policy: Policy, rec: plans.Recording | None = None):
    """launch_backward without a plan (the dispatch recorded into `rec`)."""
    if not ft.INTERPRET:
        _first_call()
        precompile.wait_all()  # a background compile of these kernels, if any, is finished first
    q4, k4, v4, o4 = _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(o)
    Z, H, n_q, _ = q4.shape
    lse3 = lse.reshape(Z, H, n_q)
    if lse3.stride() != (H * n_q, n_q, 1):
        lse3 = lse3.contiguous()
    with plans.recording(rec):
        do4 = _as_4d(do, "do")  # `.sum().backward()`'s zero-stride gradient: a copy the plan replays
        dq4, dk4, dv4, ran = _dispatch("bwd", policy, is_causal, q4, k4, v4, o4=o4, lse3=lse3, do4=do4)
    return dq4.view(q.shape), dk4.view(k.shape), dv4.view(v.shape), ran


def flash_forward(q, k, v, is_causal: bool = False, *,
                  policy: Policy | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [..., n_q, d] in q's dtype, L [..., n_q] float32): launch_forward without what ran."""
    o, lse, _ = launch_forward(q, k, v, is_causal, policy=policy)
    return o, lse


# ------------------------------------------------------------------------------ autograd.Function


class FlashAttentionTriton(torch.autograd.Function):
    """`FlashAttentionTriton.apply(q, k, v, is_causal=False, deterministic=None, policy=None)`:
    q [..., Hq, n_q, d], k and v [..., Hkv, n_k, d] with Hq a multiple of Hkv (or [..., n, d] alike).

    deterministic: None = the policy's (default_policy(): the fastest measured backward for the shape);
    True = the atomics-free backward (bitwise reproducible); False = the one-launch atomic backward.
    Saves q, k, v, o and L (float32, shape q.shape[:-1]) for the backward pass, nothing else. What ran is
    on the output's autograd node: `kernels_ran(o)`. Eager only (any policy); compiled code calls
    `flash_attention`, the custom ops with the default policy."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, deterministic=None, policy=None):
        policy = policy or default_policy()
        if deterministic is not None and policy.deterministic is not bool(deterministic):
            policy = replace(policy, deterministic=bool(deterministic))
        is_causal = bool(is_causal)
        key = plans.key(("fwd", is_causal, policy), (q, k, v)) if plans.ENABLED else None
        o, lse, ran = launch_forward(q, k, v, is_causal, policy=policy,
                                     precompile_backward=True in ctx.needs_input_grad, key=key)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.policy, ctx.ran, ctx.key = is_causal, policy, ran, key
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv, ran = launch_backward(q, k, v, o, lse, do, ctx.is_causal, policy=ctx.policy,
                                          forward_key=ctx.key)
        ctx.ran = {**ctx.ran, **ran}
        return dq, dk, dv, None, None, None


def kernels_ran(o: torch.Tensor) -> Ran:
    """What FlashAttentionTriton.apply ran to compute `o`: {"fwd": tiles}, and once the backward ran, its
    kernels too ("dq" and "dkdv", "dkdv+dq" for the fused tl one, or "bwd" for the Gluon one launch)."""
    ran = getattr(o.grad_fn, "ran", None)
    if ran is None:
        raise ValueError("kernels_ran needs the output of FlashAttentionTriton.apply on inputs that require grad")
    return dict(ran)


# ------------------------------------------------------------------------------------- custom ops
# The forward and backward as torch.library custom ops (as flash-attention's interface registers its own):
# torch.compile sees them as opaque calls with shapes from the fake implementations, so a compiled model
# keeps one graph through its attention. They run the default policy.
#
# Why two autograd paths, chosen by torch.compiler.is_compiling() in flash_attention:
# - Under torch.compile only an op works: Dynamo cannot trace the launchers (the tuner's dict and disk
#   cache, the Gluon/tl choice, Triton's launch), so FlashAttentionTriton there is a graph break.
# - Eagerly only FlashAttentionTriton does all the job: an op's arguments are tensors and scalars, so it
#   cannot take a Policy (flash check, bench attention --policy) nor hand back what ran (kernels_ran); its
#   forward runs below autograd, so it cannot see that a backward will follow (needs_input_grad), which
#   starts the backward's compiles (_precompile_backward). And each op call costs the dispatcher: with
#   empty bodies, 27-35 µs per forward call against 8-11 µs for an autograd.Function (CPU, this repo's
#   2-core VM, torch 2.13, 2026-12-05), where the launchers' own Python is 63 µs per fwd+bwd (same VM,
#   kernels stubbed: docs/kernels.md).
# Both paths save the same tensors (q, k, v, o, L) and run the same launch_forward / launch_backward.


@torch.library.custom_op("lmsys::flash_fwd", mutates_args=())
def _flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse, _ = launch_forward(q, k, v, is_causal)
    return o, lse


@_flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, is_causal):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("lmsys::flash_bwd", mutates_args=())
def _flash_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
               lse: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, _ = launch_backward(q, k, v, o, lse, do, is_causal)
    return dq, dk, dv


@_flash_bwd.register_fake
def _flash_bwd_fake(do, q, k, v, o, lse, is_causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_fwd_setup_context(ctx, inputs, output):
    q, k, v, is_causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = is_causal
    ctx.mark_non_differentiable(lse)


def _flash_fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(do, q, k, v, o, lse, ctx.is_causal)
    return dq, dk, dv, None


_flash_fwd.register_autograd(_flash_fwd_backward, setup_context=_flash_fwd_setup_context)


def flash_attention(q, k, v, is_causal: bool = False):
    """softmax(q kᵀ/√d) v with the default policy: under torch.compile through the custom ops (no graph
    break), eagerly through FlashAttentionTriton (the same kernels, without the ops' dispatch cost)."""
    if torch.compiler.is_compiling():
        return _flash_fwd(q, k, v, bool(is_causal))[0]
    return FlashAttentionTriton.apply(q, k, v, is_causal)

"""FlashAttention-2 forward and backward as Triton kernels: the tl kernels, their configs (what fits, what
the tuner times per shape class, the choice kept on disk by lmsys.kernels.tuning, keyed by this file's
hash) and the host launchers that run them on [Z, H, n, d] tensors under a `Policy`. lmsys.kernels.flash
holds what callers run (Policy, the Gluon/tl dispatch, the backward precompile, FlashAttentionTriton, the
custom ops); those names stay importable from here. How it works and where the defaults come from:
docs/kernels.md. Limits: q [..., Hq, n_q, d], k and v [..., Hkv, n_k, d] with Hq a multiple of Hkv, any
n_q, n_k >= 1, causal top-left aligned; head dims that are multiples of 8 from 16 to 256 in fp16 and bf16,
up to 128 in fp32 (split dots: lmsys.kernels.dots), only where the smallest tile fits the GPU's shared
memory. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (set before this module is imported).
"""

from __future__ import annotations

import functools
import hashlib
import math
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation  # which allocator this thread has (see _set_tma_allocator)

from lmsys.core.devices import capability, sm_count
from lmsys.kernels import plans, triton_compat, triton_interpreted, tuning
from lmsys.kernels.dots import dot_precision as _dot_precision  # fp32's split dots

if TYPE_CHECKING:
    from lmsys.kernels.flash import Policy

MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 16, 256, 8
HEAD_DIMS = tuple(range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, HEAD_DIM_STEP))
FP32_MAX_HEAD_DIM = 128  # fp32 tiles 256 wide overflowed an H200's shared memory whatever the config
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRET = triton_interpreted()  # read by Triton when the kernels are decorated
triton_compat.patch_interpreter()  # triton 3.6/3.7's interpreter under numpy >= 2.4

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# Triton's interpreter multiplies bfloat16 tiles as their raw 16-bit integers (seen with triton 3.9.0):
# under it, bf16 dot operands are widened to fp32 first. Compiled kernels never take that branch.
_WIDEN_BF16_DOTS = tl.constexpr(INTERPRET)


def head_dim_pad(d: int) -> int:
    """The tile width for head dim d: the next power of two (tl.arange's extents must be powers of two).
    Plain Python: triton.next_power_of_2 is a constexpr function whose wrapper costs µs on every call."""
    return 1 << (d - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv without its constexpr wrapper (the launchers run it on every call)


MAX_FAST_ROWS = 65535 * 16  # heads-fast grids put the tiles (16 rows or more) on a grid dim of at most 65,535


def _grid(tiles: int, heads: int, batch: int, heads_fast: bool) -> tuple:
    """A plain grid; heads-fast, tiles last: every head's heaviest tile before any's next (`_program`)."""
    return (heads, batch, tiles) if heads_fast else (tiles, heads, batch)


# ------------------------------------------------------------------------------------------ helpers


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """a @ b (+ acc) with float32 accumulation."""
    if _WIDEN_BF16_DOTS:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _load(ptrs, rows_ok, cols_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D tile [R, C], masked (zeros) only along the dims that need it: rows_ok [R], cols_ok [C]."""
    if MASK_ROWS and MASK_COLS:
        return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    if MASK_ROWS:
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    if MASK_COLS:
        return tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _store(ptrs, x, rows_ok, cols_ok, MASK_COLS: tl.constexpr):
    """Store a 2-D tile, rows masked; columns too when the head dim is padded."""
    tl.store(ptrs, x, mask=rows_ok[:, None] & cols_ok[None, :] if MASK_COLS else rows_ok[:, None])


@triton.jit
def _streamed(base, n_rows, stride_row, offs_row, offs_d, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
              BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr):
    """A [n_rows, HEAD_DIM] operand that a loop walks in tiles of BLOCK rows, at row 0: a tensor descriptor
    of [BLOCK, HEAD_DIM_PAD] blocks (USE_TMA: rows past n_rows and columns past HEAD_DIM load as zeros),
    or a pointer tile, [HEAD_DIM_PAD, BLOCK] when TRANSPOSED, else [BLOCK, HEAD_DIM_PAD]."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                        block_shape=[BLOCK, HEAD_DIM_PAD])
    elif TRANSPOSED:
        src = base + offs_row[None, :] * stride_row + offs_d[:, None]
    else:
        src = base + offs_row[:, None] * stride_row + offs_d[None, :]
    return src


@triton.jit
def _fwd_step(acc, l_i, m_i, q, K_src, V_src, start_n, stride_kn, stride_vn, offs_m, offs_n, d_ok, N_K, qk_scale,
              STAGE: tl.constexpr, IS_CAUSAL: tl.constexpr, PAD_D: tl.constexpr, USE_TMA: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax. K_src/V_src: tensor descriptors (USE_TMA) or pointer tiles,
    Kᵀ [HEAD_DIM_PAD, BLOCK_N] and V [BLOCK_N, HEAD_DIM_PAD] at key 0."""
    key_ok = (start_n + offs_n) < N_K
    if USE_TMA:  # rows past N_K and columns past HEAD_DIM come back as zeros
        kT = tl.trans(K_src.load([start_n, 0]))
    else:
        kT = _load(K_src + start_n * stride_kn, d_ok, key_ok, PAD_D, STAGE == 2)
    qk = _dot(q, kT, None, DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if STAGE == 1:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_ij[:, None]
    else:
        visible = key_ok[None, :]
        if IS_CAUSAL:
            visible = visible & (offs_m[:, None] >= (start_n + offs_n)[None, :])
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))  # finite: every row saw key 0 in the first tile
        qk = qk - m_ij[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_ij)  # rescales what was accumulated under the old maximum
    l_i = l_i * alpha + tl.sum(p, 1)
    if USE_TMA:
        v = V_src.load([start_n, 0])
    else:
        v = _load(V_src + start_n * stride_vn, key_ok, d_ok, STAGE == 2, PAD_D)
    acc = acc * alpha[:, None]
    acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
    return acc, l_i, m_ij


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, K_src, V_src, stride_kn, stride_vn, offs_m, offs_n, d_ok, lo, hi, N_K, qk_scale,
               STAGE: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
               USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over the key tiles [lo, hi) for one query tile."""
    if WARP_SPEC:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K_src, V_src, start_n, stride_kn, stride_vn, offs_m, offs_n,
                                      d_ok, N_K, qk_scale, STAGE, IS_CAUSAL, PAD_D, USE_TMA, DOT_PRECISION)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, K_src, V_src, start_n, stride_kn, stride_vn, offs_m, offs_n,
                                      d_ok, N_K, qk_scale, STAGE, IS_CAUSAL, PAD_D, USE_TMA, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q_src, DO_src, O_src, L_ptrs, D_ptrs, DQ_dst, stride_qm, stride_dom, stride_om,
                stride_dqm, offs_n, offs_m, d_ok, lo, hi, N_Q, sm_scale, qk_scale, STAGE: tl.constexpr,
                IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, PAD_D: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                USE_TMA: tl.constexpr, TMA_DQ: tl.constexpr, WITH_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK, dV of one key tile from the query tiles [lo, hi). Q_src, DO_src, O_src: tensor descriptors
    (USE_TMA) or pointer tiles, Qᵀ [HEAD_DIM_PAD, BLOCK_M], dO and O [BLOCK_M, HEAD_DIM_PAD] at query 0; O
    is read only with WITH_DQ, where D = rowsum(dO ∘ O) is computed here instead of loaded. With ATOMIC_DQ,
    also adds this key tile's share of dQ (dS K · scale, float32) into DQ_dst: a tensor descriptor's
    reduce-add (TMA_DQ: one bulk asynchronous add of the tile from shared memory, as FlashAttention-3 does)
    or element-wise atomics on a pointer tile [BLOCK_M, HEAD_DIM_PAD] at query 0."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        row_ok = (start_m + offs_m) < N_Q
        if USE_TMA:  # rows past N_Q and columns past HEAD_DIM come back as zeros
            qT = tl.trans(Q_src.load([start_m, 0]))
        else:
            qT = _load(Q_src + start_m * stride_qm, d_ok, row_ok, PAD_D, STAGE == 2)
        if STAGE == 1:
            lse = tl.load(L_ptrs + start_m)
        else:
            lse = tl.load(L_ptrs + start_m, mask=row_ok, other=0.0)
        sT = _dot(k, qT, None, DOT_PRECISION) * qk_scale - lse[None, :] * _LOG2E  # [BLOCK_N, BLOCK_M], log2 P
        if USE_TMA:
            do = DO_src.load([start_m, 0])
        else:
            do = _load(DO_src + start_m * stride_dom, row_ok, d_ok, STAGE == 2, PAD_D)
        if WITH_DQ:  # D of these rows, as _attn_bwd_preprocess computes it
            if USE_TMA:
                o = O_src.load([start_m, 0])
            else:
                o = _load(O_src + start_m * stride_om, row_ok, d_ok, STAGE == 2, PAD_D)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        elif STAGE == 1:
            delta = tl.load(D_ptrs + start_m)
        else:
            delta = tl.load(D_ptrs + start_m, mask=row_ok, other=0.0)
        if STAGE == 2:
            visible = row_ok[None, :]
            if IS_CAUSAL:
                visible = visible & ((start_m + offs_m)[None, :] >= offs_n[:, None])
            sT = tl.where(visible, sT, float("-inf"))
        pT = tl.math.exp2(sT)
        dv = _dot(pT.to(do.dtype), do, dv, DOT_PRECISION)
        dpT = _dot(v, tl.trans(do), None, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        dsT = pT * (dpT - delta[None, :])
        dk = _dot(dsT.to(qT.dtype), tl.trans(qT), dk, DOT_PRECISION)
        if ATOMIC_DQ:
            dq = _dot(tl.trans(dsT.to(k.dtype)), k, None, DOT_PRECISION) * sm_scale  # [BLOCK_M, HEAD_DIM_PAD]
            if TMA_DQ:  # rows past N_Q and columns past HEAD_DIM are dropped
                DQ_dst.atomic_add([start_m, 0], dq)
            else:
                tl.atomic_add(DQ_dst + start_m * stride_dqm, dq, mask=row_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, K_src, V_src, stride_kn, stride_vn, offs_m, offs_n, d_ok, lo, hi, N_K,
              qk_scale, STAGE: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
              USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ of one query tile from the key tiles [lo, hi). K_src, V_src: tensor descriptors (USE_TMA) or
    pointer tiles [HEAD_DIM_PAD, BLOCK_N] (Kᵀ, Vᵀ) at key 0."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        key_ok = (start_n + offs_n) < N_K
        if USE_TMA:  # rows past N_K and columns past HEAD_DIM come back as zeros
            kT = tl.trans(K_src.load([start_n, 0]))
            vT = tl.trans(V_src.load([start_n, 0]))
        else:
            kT = _load(K_src + start_n * stride_kn, d_ok, key_ok, PAD_D, STAGE == 2)
            vT = _load(V_src + start_n * stride_vn, d_ok, key_ok, PAD_D, STAGE == 2)
        s = _dot(q, kT, None, DOT_PRECISION) * qk_scale - lse2[:, None]  # [BLOCK_M, BLOCK_N], log2 P
        if STAGE == 2:
            visible = key_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (offs_m[:, None] >= (start_n + offs_n)[None, :])
            s = tl.where(visible, s, float("-inf"))
        p = tl.math.exp2(s)
        dp = _dot(do, vT, None, DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(kT.dtype), tl.trans(kT), dq, DOT_PRECISION)
    return dq


# ------------------------------------------------------------------------------- autotune configs


def _config(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# (BLOCK_M, BLOCK_N, warps, stages) on a GPU; without autotuning, the first that fits is taken (where they
# come from: docs/kernels.md). The dK/dV kernel takes the "dkdv" list also when it accumulates
# dQ (deterministic=False).
GPU_CONFIGS = {
    "fwd": [_config(128, 64, 8, 3), _config(128, 64, 4, 3), _config(64, 64, 4, 3), _config(64, 128, 4, 3),
            _config(64, 32, 4, 2)],
    "dkdv": [_config(64, 64, 4, 3), _config(64, 128, 8, 3), _config(32, 128, 4, 3), _config(32, 64, 4, 3),
             _config(32, 32, 4, 2)],
    "dq": [_config(64, 128, 4, 3), _config(64, 64, 4, 3), _config(128, 64, 8, 3), _config(64, 32, 4, 3),
           _config(32, 32, 4, 2)],
}
# Larger tiles and deeper pipelines for d 64, picked from with Policy(wide_configs=True, pick=i).
WIDE_CONFIGS = {
    "fwd": [_config(128, 128, 8, 3), _config(128, 128, 8, 4), _config(256, 64, 8, 3), _config(128, 64, 4, 4)],
    "dkdv": [_config(128, 128, 8, 3), _config(64, 128, 8, 4), _config(128, 64, 8, 3), _config(64, 64, 4, 4)],
    "dq": [_config(128, 128, 8, 3), _config(128, 64, 8, 4), _config(64, 128, 4, 4), _config(128, 64, 4, 3)],
}
# In the interpreter: one small config per kernel (nothing to time), so small test inputs span several
# tiles, with BLOCK_M != BLOCK_N both ways round.
INTERPRETER_CONFIGS = {"fwd": [_config(32, 16, 4, 1)], "dkdv": [_config(16, 32, 4, 1)], "dq": [_config(32, 16, 4, 1)]}
CONFIGS = INTERPRETER_CONFIGS if INTERPRET else GPU_CONFIGS
# fp32 on a GPU: the fastest with bf16x6 dots on an H100 (d 64's first, then d 128's), GPU_CONFIGS' cheapest
# last (docs/benchmarks/attention-h100-tables.md, "fp32 dots").
FP32_GPU_CONFIGS = {
    "fwd": [_config(128, 64, 8, 3), _config(128, 64, 8, 1), _config(64, 64, 4, 1), _config(64, 32, 4, 2)],
    "dq": [_config(128, 64, 8, 3), _config(128, 32, 8, 1), _config(64, 64, 4, 1), _config(32, 32, 4, 2)],
    "dkdv": [_config(32, 64, 4, 3), _config(32, 32, 4, 2), _config(32, 64, 4, 2)],
}
FP32_CONFIGS = INTERPRETER_CONFIGS if INTERPRET else FP32_GPU_CONFIGS


def base_configs(kernel: str, dtype) -> list:
    """The configs `kernel` chooses from at `dtype` without a Policy's own."""
    return FP32_CONFIGS[kernel] if dtype == torch.float32 else CONFIGS[kernel]


ACC_PER_THREAD = 128  # float32 accumulator registers per thread above which the kernel spills


@functools.lru_cache(maxsize=None)
def _device_shared_memory(index: int) -> int:
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except (AttributeError, KeyError, RuntimeError):
        return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def shared_memory(device) -> int | None:
    """Bytes of shared memory one block may use on this GPU (from the device); None off a GPU (the
    interpreter has no such limit)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _device_shared_memory(device.index if device.index is not None else torch.cuda.current_device())


def _tile_budget(kernel: str):
    """(accumulator floats, shared-memory bytes) of a config for one kernel, as a function of the tiles
    (d: the padded head dim). The probability tile that feeds the second product is staged too, twice for
    fp32 (the split dots stage its parts): so counted, with tf32x3, the estimate matched what triton 3.6
    asked for at d 128 in fp32 on an H200. At d 256 in fp32 it asked for more than any config's estimate:
    hence FP32_MAX_HEAD_DIM."""

    def staged_p(bm, bn, elem):
        return bm * bn * (2 if elem == 4 else 1)

    def fwd(bm, bn, d, stages, elem):  # acc [BM, d]; q resident, k and v pipelined, p staged
        return bm * d, elem * (bm * d + stages * 2 * bn * d + staged_p(bm, bn, elem))

    def dkdv(bm, bn, d, stages, elem):  # dk, dv [BN, d]; k, v resident, q and dO pipelined, pᵀ and dsᵀ staged
        return 2 * bn * d, elem * (2 * bn * d + stages * 2 * bm * d + 2 * staged_p(bm, bn, elem))

    def dq(bm, bn, d, stages, elem):  # dq [BM, d]; q, dO resident, k and v pipelined, ds staged
        return bm * d, elem * (2 * bm * d + stages * 2 * bn * d + staged_p(bm, bn, elem))

    return {"fwd": fwd, "dkdv": dkdv, "dq": dq}[kernel]


def _cost(kernel: str, config: triton.Config, d_pad: int, elem: int) -> tuple[float, int]:
    """(accumulator floats per thread, shared-memory bytes) of `config` for `kernel`."""
    acc, smem = _tile_budget(kernel)(*_tiles(config)[:2], d_pad, config.num_stages, elem)
    return acc / (32 * config.num_warps), smem


def _fits(kernel: str, config: triton.Config, d_pad: int, elem: int, smem: int | None) -> bool:
    acc, tiles = _cost(kernel, config, d_pad, elem)
    return acc <= ACC_PER_THREAD and (smem is None or tiles <= smem)


def fitting_configs(kernel: str, configs: list, *, d_pad: int, elem: int, smem: int | None) -> list:
    """The configs whose accumulators would not spill and whose tiles fit in `smem` bytes of shared memory
    (no limit when None), in their order; at least one: the cheapest, when none fits."""
    kept = [c for c in configs if _fits(kernel, c, d_pad, elem, smem)]
    return kept or [min(configs, key=lambda c: tuple(reversed(_cost(kernel, c, d_pad, elem))))]


# triton 3.6's warp-specialisation pass on Hopper compiles the forward only at 8 warps.
WARP_SPEC_MIN_WARPS = 8


def warp_spec_configs(configs: list, *, d_pad: int, elem: int, smem: int | None) -> list:
    """The forward configs a warp-specialised forward can run: enough warps for the pass, and fitting
    (none: the forward runs without warp specialisation). All of them under the interpreter."""
    return list(configs) if INTERPRET else [c for c in configs if c.num_warps >= WARP_SPEC_MIN_WARPS
                                            and _fits("fwd", c, d_pad, elem, smem)]


def _candidates(kernel: str, configs: list, consts: dict, q: torch.Tensor) -> list:
    """The configs `kernel` may run at these constants and inputs, in their order (at least one)."""
    budget = dict(d_pad=consts["HEAD_DIM_PAD"], elem=q.element_size(), smem=shared_memory(q.device))
    if consts.get("WARP_SPEC"):
        return warp_spec_configs(configs, **budget)  # _tl_forward asks for it only where this is not empty
    fitting = fitting_configs(kernel, configs, **budget)
    if consts.get("WITH_DQ"):  # the fused dQ programs run the same tiles, query tile BLOCK_M
        return [c for c in fitting if _fits("dq", c, **budget)] or fitting
    return fitting


TUNED_CANDIDATES = 2  # configs the tuner times per kernel and shape class, at most
# At padded head dims above 64 (not fp32) the tuner tries first the config a sweep found best at d 128 (bf16,
# causal, seq 16384: docs/benchmarks/attention.md, "Autotune configs"); elsewhere its list's order.
WIDE_HEAD_FIRST = {"fwd": (128, 64, 8, 3), "dkdv": (64, 128, 8, 3), "dq": (128, 64, 8, 3)}


def _shortlist(kernel: str, fitting: list, *, d_pad: int, rows: int, heads: int, programs: int,
               fp32: bool = False) -> list:
    """The configs of `fitting` the tuner times (at most TUNED_CANDIDATES): the preferred one; then, where
    its grid over `rows` (query rows, key rows for dK/dV) and `heads` leaves some of `programs` (SMs)
    idle, the preferred one with a smaller tile along the rows, else the next preferred one."""
    first = WIDE_HEAD_FIRST[kernel] if d_pad > 64 and not fp32 else None  # fp32: its own list's order
    order = sorted(fitting, key=lambda c: _tiles(c) != first)  # stable: the rest keep their order
    side = "BLOCK_N" if kernel == "dkdv" else "BLOCK_M"
    best = order[0]
    smaller = [c for c in order if c.kwargs[side] < best.kwargs[side]]
    if _cdiv(rows, best.kwargs[side]) * heads < programs and smaller:
        return [best, smaller[0]]
    return order[:TUNED_CANDIDATES]


def _tiles(config: triton.Config) -> tuple:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _kernels() -> dict:  # the tuned kernels by name (defined below)
    return {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}


def _launch(kernel: str, grid, args: tuple, consts: dict, policy: Policy, q: torch.Tensor, *, shape: tuple,
            names: tuple = (), reset=None, prepare: list | None = None) -> str:
    """Run `kernel` as `policy` says; the tiles it ran, "BLOCK_M×BLOCK_N". shape: (Z, H, GROUP, n_q, n_k);
    names: the tensors among the leading args, by name (see plans.launch); reset: what undoes a run's
    accumulation before the next (the atomic backward's dQ.zero_), for timing.
    prepare: a list to append the compiles (warmups) of what would run to, instead of running it."""
    fn = _kernels()[kernel]
    if policy.pick is None:
        if policy.configs is not None or policy.wide_configs:
            raise ValueError("Policy.configs or wide_configs needs a pick (the tuner times its own lists only)")
        config = _tuned(kernel, fn, grid, args, consts, q, shape, reset, prepare)
    else:
        fitting = _candidates(kernel, policy.configs_for(kernel, q.dtype), consts, q)
        config = fitting[policy.pick % len(fitting)]
    if prepare is not None:
        if config is not None:  # None: _tuned added its shortlist
            prepare.append(functools.partial(fn.warmup, *args, grid=grid, **consts, **config.all_kwargs()))
        return ""
    plans.launch(fn, grid, args, {**consts, **config.all_kwargs()}, names)
    return f"{config.kwargs['BLOCK_M']}×{config.kwargs['BLOCK_N']}"


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _stamp() -> dict:
    """What the tuner's stored choices hold for: the versions and this file (kernels and configs)."""
    return {"torch": torch.__version__, "triton": triton.__version__, "source": _source_digest()}


TUNER = tuning.Tuner("flash_triton", _stamp)
# The constants of a shape class besides the lengths (the dtype and the device are keyed apart)
_CLASS_CONSTS = ("HEAD_DIM_PAD", "IS_CAUSAL", "USE_TMA", "WARP_SPEC", "PERSISTENT", "ATOMIC_DQ", "TMA_DQ",
                 "DOT_PRECISION", "WITH_DQ")
MIN_ROWS, MAX_ROWS = 64, 16384  # lengths are bucketed to powers of two in this range
MAX_HEADS = 256  # batch × heads, bucketed alike from 1


@functools.lru_cache(maxsize=None)
def _device_tag(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    major, minor = capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


def _tuned(kernel: str, fn, grid, args: tuple, consts: dict, q: torch.Tensor, shape: tuple, reset,
           prepare: list | None = None):
    """The config `kernel` runs at this shape class (`TUNER`'s key: kernel, device, dtype, _CLASS_CONSTS,
    n_q, n_k, batch × heads and the group bucketed): chosen among `_shortlist` of the fitting configs.
    With `prepare`, nothing is timed: the config the tuner knows without timing, else None with the
    shortlist's compiles appended to `prepare` (the real call times them on its own thread)."""
    Z, H, group, n_q, n_k = shape
    key = (kernel, _device_tag(q.device), q.dtype, *(consts.get(name) for name in _CLASS_CONSTS),
           tuning.bucket(n_q, floor=MIN_ROWS, cap=MAX_ROWS), tuning.bucket(n_k, floor=MIN_ROWS, cap=MAX_ROWS),
           tuning.bucket(Z * H, floor=1, cap=MAX_HEADS), tuning.bucket(group, floor=1, cap=MAX_HEADS))
    config = TUNER.memory.get(key)
    if config is not None:
        return config
    fitting = _candidates(kernel, base_configs(kernel, q.dtype), consts, q)
    rows, heads = (key[-3], key[-2] // key[-1]) if kernel == "dkdv" else (key[-4], key[-2])
    programs = _persistent_programs(q.device)  # the SMs the shortlist sizes its waves against
    shortlist = _shortlist(kernel, fitting, d_pad=consts["HEAD_DIM_PAD"], rows=rows, heads=max(heads, 1),
                           programs=programs, fp32=q.dtype == torch.float32)

    def run(config):
        if reset is not None:
            reset()
        fn[grid](*args, **consts, **config.all_kwargs())

    def compile_one(config):
        fn.warmup(*args, grid=grid, **consts, **config.all_kwargs())

    if prepare is not None:
        config = TUNER.known(key, shortlist)
        if config is None:
            prepare.extend(functools.partial(compile_one, c) for c in shortlist)
        return config
    config = TUNER.choose(key, shortlist, run, None if INTERPRET else compile_one)
    if reset is not None and len(shortlist) > 1:
        reset()  # after the timed runs (if any) the real one starts from zeros
    return config


# --------------------------------------------------------------------------------------- forward


@triton.jit(do_not_specialize=["Z", "N_Q", "N_K"])
def _attn_fwd(Q, K, V, O, L, sm_scale,
              stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
              stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
              Z, H, GROUP, N_Q, N_K,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HEADS_FAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
              PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, query head, batch); with PERSISTENT, a 1-D grid of at most one program
    per SM, each looping over those work items (Z, the batch, is read only then)."""
    if PERSISTENT:
        # Work item t in [0, tiles): causal, heaviest first over every head (t's query tile counts down
        # from the last, all batch·heads of one tile together); otherwise tile-fastest within a head, as the
        # plain grid. Program p takes item r·G + p in even rounds r and r·G + G-1-p in odd ones (G programs):
        # the snake evens out the work each program gets when the items grow lighter round by round.
        n_m = tl.cdiv(N_Q, BLOCK_M)
        n_zh = Z * H
        tiles = n_m * n_zh
        G = tl.num_programs(0)
        p = tl.program_id(0)
        for r in range(0, tl.cdiv(tiles, G)):
            t = r * G + tl.where(r % 2 == 0, p, G - 1 - p)
            if t < tiles:
                if IS_CAUSAL:
                    pid_m = n_m - 1 - t // n_zh
                    zh = t % n_zh
                else:
                    pid_m = t % n_m
                    zh = t // n_m
                _fwd_tile(Q, K, V, O, L, sm_scale, stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                          stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om, H, GROUP, N_Q, N_K,
                          pid_m, zh % H, zh // H, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, DOT_PRECISION, USE_TMA,
                          WARP_SPEC, BLOCK_M, BLOCK_N)
    else:
        pid_m, off_h, off_z = _program(HEADS_FAST, IS_CAUSAL)
        _fwd_tile(Q, K, V, O, L, sm_scale, stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                  stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om, H, GROUP, N_Q, N_K,
                  pid_m, off_h, off_z, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, DOT_PRECISION,
                  USE_TMA, WARP_SPEC, BLOCK_M, BLOCK_N)


@triton.jit
def _program(HEADS_FAST: tl.constexpr, LAST_FIRST: tl.constexpr):
    """(tile, head, batch) of this program; tiles from the last with LAST_FIRST; HEADS_FAST: `_grid`'s."""
    if HEADS_FAST:
        t, n = tl.program_id(2), tl.num_programs(2)
        return n - 1 - t if LAST_FIRST else t, tl.program_id(0), tl.program_id(1)
    t, n = tl.program_id(0), tl.num_programs(0)
    return n - 1 - t if LAST_FIRST else t, tl.program_id(1), tl.program_id(2)


@triton.jit
def _fwd_tile(Q, K, V, O, L, sm_scale,
              stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
              stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
              H, GROUP, N_Q, N_K, pid_m, off_h, off_z,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr,
              DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward of one query tile of one (batch, query head): O and L for its rows."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    z64, h64 = off_z.to(tl.int64), off_h.to(tl.int64)
    hk64 = (off_h // GROUP).to(tl.int64)  # the key/value head this query head reads
    q_base = Q + z64 * stride_qz + h64 * stride_qh
    k_base = K + z64 * stride_kz + hk64 * stride_kh
    v_base = V + z64 * stride_vz + hk64 * stride_vh
    o_base = O + z64 * stride_oz + h64 * stride_oh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < N_Q
    if USE_TMA:
        q = tl.make_tensor_descriptor(q_base, shape=[N_Q, HEAD_DIM], strides=[stride_qm, 1],
                                      block_shape=[BLOCK_M, HEAD_DIM_PAD]).load([start_m, 0])
    else:
        q = _load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], row_ok, d_ok, True, PAD_D)
    K_src = _streamed(k_base, N_K, stride_kn, offs_n, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, USE_TMA)
    V_src = _streamed(v_base, N_K, stride_vn, offs_n, offs_d, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, False, USE_TMA)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E

    n_k_full = (N_K // BLOCK_N) * BLOCK_N  # key tiles wholly inside the sequence
    if IS_CAUSAL:
        full_end = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, n_k_full)  # tiles wholly below the diagonal
        masked_end = tl.minimum(start_m + BLOCK_M, N_K)  # later tiles are wholly above it: never visited
    else:
        full_end = n_k_full
        masked_end = N_K
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_src, V_src, stride_kn, stride_vn, offs_m, offs_n, d_ok,
                               0, full_end, N_K, qk_scale, 1, IS_CAUSAL, BLOCK_N, PAD_D, USE_TMA, WARP_SPEC,
                               DOT_PRECISION)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_src, V_src, stride_kn, stride_vn, offs_m, offs_n, d_ok,
                               full_end, masked_end, N_K, qk_scale, 2, IS_CAUSAL, BLOCK_N, PAD_D, USE_TMA, WARP_SPEC,
                               DOT_PRECISION)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * _LN2  # natural-log logsumexp of the scaled scores
    tl.store(L + (z64 * H + h64) * N_Q + offs_m, lse, mask=row_ok)
    _store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], acc.to(O.dtype.element_ty), row_ok, d_ok, PAD_D)


# -------------------------------------------------------------------------------------- backward


@triton.jit(do_not_specialize=["N_Q"])
def _attn_bwd_preprocess(O, DO, Delta, DQ, stride_oz, stride_oh, stride_om, stride_doz, stride_doh, stride_dom,
                         H, N_Q, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO ∘ O) into Delta [Z, H, N_Q]; zeros into DQ's rows (float32 [Z, H, N_Q, HEAD_DIM], contiguous)."""
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < N_Q
    o = _load(O + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :], row_ok, d_ok, True, HEAD_DIM != HEAD_DIM_PAD)
    do = _load(DO + off_z.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh
               + offs_m[:, None] * stride_dom + offs_d[None, :], row_ok, d_ok, True, HEAD_DIM != HEAD_DIM_PAD)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    rows = (off_z * H + off_h).to(tl.int64) * N_Q + offs_m
    tl.store(Delta + rows, delta, mask=row_ok)
    tl.store(DQ + rows[:, None] * HEAD_DIM + offs_d[None, :], tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_bwd_dkdv(Q, K, V, O, DO, L, Delta, DK, DV, DQ, sm_scale,
                   stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                   stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
                   stride_doz, stride_doh, stride_dom, stride_dkz, stride_dkh, stride_dkn,
                   stride_dvz, stride_dvh, stride_dvn, stride_dqz, stride_dqh, stride_dqm,
                   H, GROUP, N_Q, N_K, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr,
                   HEADS_FAST: tl.constexpr, DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                   USE_TMA: tl.constexpr, TMA_DQ: tl.constexpr, WITH_DQ: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """One program per (key tile, key/value head): walks the query tiles of every query head of its group
    that see it. No atomics for dK, dV (it owns those rows); with ATOMIC_DQ it also adds into DQ (float32).
    WITH_DQ (the whole backward in one launch, without atomics: host-bound calls): programs past the key
    tiles are _attn_bwd_dq's, GROUP · query tiles of them per key/value head, and every program computes
    the D it needs (Delta is not read)."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    pid, off_hk, off_z = _program(HEADS_FAST, False)
    if WITH_DQ:
        n_kt = tl.cdiv(N_K, BLOCK_N)
        if pid >= n_kt:
            n_qt = tl.cdiv(N_Q, BLOCK_M)
            r = pid - n_kt
            pid_m = r % n_qt
            if IS_CAUSAL:  # the last query tiles see the most keys: start them first
                pid_m = n_qt - 1 - pid_m
            _dq_program(Q, K, V, O, DO, L, Delta, DQ, sm_scale, stride_qz, stride_qh, stride_qm, stride_kz,
                        stride_kh, stride_kn, stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
                        stride_doz, stride_doh, stride_dom, stride_dqz, stride_dqh, stride_dqm, H, GROUP, N_Q, N_K,
                        pid_m, off_hk * GROUP + r // n_qt, off_z, HEAD_DIM, HEAD_DIM_PAD, IS_CAUSAL, DOT_PRECISION,
                        USE_TMA, False, BLOCK_M, BLOCK_N)
            return
    z64, hk64 = off_z.to(tl.int64), off_hk.to(tl.int64)

    start_n = pid * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    key_ok = offs_n < N_K
    k = _load(K + z64 * stride_kz + hk64 * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
              key_ok, d_ok, True, PAD_D)
    v = _load(V + z64 * stride_vz + hk64 * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
              key_ok, d_ok, True, PAD_D)

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    n_q_full = (N_Q // BLOCK_M) * BLOCK_M  # query tiles wholly inside the sequence
    for g in range(GROUP):  # the query heads that read this key/value head: dK, dV sum over them
        h64 = hk64 * GROUP + g
        off_zh = z64 * H + h64
        Q_src = _streamed(Q + z64 * stride_qz + h64 * stride_qh, N_Q, stride_qm, offs_m, offs_d, HEAD_DIM,
                          HEAD_DIM_PAD, BLOCK_M, True, USE_TMA)
        DO_src = _streamed(DO + z64 * stride_doz + h64 * stride_doh, N_Q, stride_dom, offs_m, offs_d, HEAD_DIM,
                           HEAD_DIM_PAD, BLOCK_M, False, USE_TMA)
        O_src = _streamed(O + z64 * stride_oz + h64 * stride_oh, N_Q, stride_om, offs_m, offs_d, HEAD_DIM,
                          HEAD_DIM_PAD, BLOCK_M, False, USE_TMA and WITH_DQ)
        DQ_dst = _streamed(DQ + z64 * stride_dqz + h64 * stride_dqh, N_Q, stride_dqm, offs_m, offs_d, HEAD_DIM,
                           HEAD_DIM_PAD, BLOCK_M, False, TMA_DQ)
        L_ptrs = L + off_zh * N_Q + offs_m
        D_ptrs = Delta + off_zh * N_Q + offs_m
        if IS_CAUSAL:
            first = (start_n // BLOCK_M) * BLOCK_M  # earlier query tiles see none of these keys
            diag_end = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M  # from here every query sees every key
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_src, DO_src, O_src, L_ptrs, D_ptrs, DQ_dst, stride_qm,
                                 stride_dom, stride_om, stride_dqm, offs_n, offs_m, d_ok, first,
                                 tl.minimum(diag_end, N_Q), N_Q, sm_scale, qk_scale, 2, IS_CAUSAL, BLOCK_M, PAD_D,
                                 ATOMIC_DQ, USE_TMA, TMA_DQ, WITH_DQ, DOT_PRECISION)
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_src, DO_src, O_src, L_ptrs, D_ptrs, DQ_dst, stride_qm,
                                 stride_dom, stride_om, stride_dqm, offs_n, offs_m, d_ok, diag_end, n_q_full, N_Q,
                                 sm_scale, qk_scale, 1, IS_CAUSAL, BLOCK_M, PAD_D, ATOMIC_DQ, USE_TMA, TMA_DQ, WITH_DQ,
                                 DOT_PRECISION)
            edge = tl.maximum(diag_end, n_q_full)
        else:
            dk, dv = _dkdv_tiles(dk, dv, k, v, Q_src, DO_src, O_src, L_ptrs, D_ptrs, DQ_dst, stride_qm,
                                 stride_dom, stride_om, stride_dqm, offs_n, offs_m, d_ok, 0, n_q_full, N_Q,
                                 sm_scale, qk_scale, 1, IS_CAUSAL, BLOCK_M, PAD_D, ATOMIC_DQ, USE_TMA, TMA_DQ, WITH_DQ,
                                 DOT_PRECISION)
            edge = n_q_full
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_src, DO_src, O_src, L_ptrs, D_ptrs, DQ_dst, stride_qm,
                             stride_dom, stride_om, stride_dqm, offs_n, offs_m, d_ok, edge, N_Q, N_Q, sm_scale,
                             qk_scale, 2, IS_CAUSAL, BLOCK_M, PAD_D, ATOMIC_DQ, USE_TMA, TMA_DQ, WITH_DQ,
                             DOT_PRECISION)

    dk = dk * sm_scale
    _store(DK + z64 * stride_dkz + hk64 * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
           dk.to(DK.dtype.element_ty), key_ok, d_ok, PAD_D)
    _store(DV + z64 * stride_dvz + hk64 * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :],
           dv.to(DV.dtype.element_ty), key_ok, d_ok, PAD_D)


@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_bwd_dq(Q, K, V, O, DO, L, Delta, DQ, sm_scale,
                 stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                 stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om,
                 stride_doz, stride_doh, stride_dom, stride_dqz, stride_dqh, stride_dqm,
                 H, GROUP, N_Q, N_K,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, HEADS_FAST: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, query head): walks the key tiles it sees (it owns its dQ rows). It
    also computes its rows of D = rowsum(dO ∘ O) and stores them for the dK/dV kernel, which runs after
    it: the preprocess launch is needed only by the one-launch (atomic) backward."""
    pid_m, off_h, off_z = _program(HEADS_FAST, IS_CAUSAL)
    _dq_program(Q, K, V, O, DO, L, Delta, DQ, sm_scale, stride_qz, stride_qh, stride_qm, stride_kz, stride_kh,
                stride_kn, stride_vz, stride_vh, stride_vn, stride_oz, stride_oh, stride_om, stride_doz, stride_doh,
                stride_dom, stride_dqz, stride_dqh, stride_dqm, H, GROUP, N_Q, N_K, pid_m, off_h, off_z, HEAD_DIM,
                HEAD_DIM_PAD, IS_CAUSAL, DOT_PRECISION, USE_TMA, True, BLOCK_M, BLOCK_N)


@triton.jit
def _dq_program(Q, K, V, O, DO, L, Delta, DQ, sm_scale,
                stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn, stride_vz, stride_vh, stride_vn,
                stride_oz, stride_oh, stride_om, stride_doz, stride_doh, stride_dom, stride_dqz, stride_dqh, stride_dqm,
                H, GROUP, N_Q, N_K, pid_m, off_h, off_z,
                HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr,
                DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, STORE_DELTA: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of query tile pid_m of one (batch, query head); D of its rows stored with STORE_DELTA."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    z64, h64 = off_z.to(tl.int64), off_h.to(tl.int64)
    hk64 = (off_h // GROUP).to(tl.int64)
    off_zh = z64 * H + h64

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < N_Q
    q = _load(Q + z64 * stride_qz + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
              row_ok, d_ok, True, PAD_D)
    do = _load(DO + z64 * stride_doz + h64 * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
               row_ok, d_ok, True, PAD_D)
    o = _load(O + z64 * stride_oz + h64 * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
              row_ok, d_ok, True, PAD_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # as _attn_bwd_preprocess computes it
    if STORE_DELTA:
        tl.store(Delta + off_zh * N_Q + offs_m, delta, mask=row_ok)
    lse2 = tl.load(L + off_zh * N_Q + offs_m, mask=row_ok, other=0.0) * _LOG2E
    K_src = _streamed(K + z64 * stride_kz + hk64 * stride_kh, N_K, stride_kn, offs_n, offs_d, HEAD_DIM,
                      HEAD_DIM_PAD, BLOCK_N, True, USE_TMA)
    V_src = _streamed(V + z64 * stride_vz + hk64 * stride_vh, N_K, stride_vn, offs_n, offs_d, HEAD_DIM,
                      HEAD_DIM_PAD, BLOCK_N, True, USE_TMA)

    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    n_k_full = (N_K // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_end = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, n_k_full)
        masked_end = tl.minimum(start_m + BLOCK_M, N_K)
    else:
        full_end = n_k_full
        masked_end = N_K
    dq = _dq_tiles(dq, q, do, lse2, delta, K_src, V_src, stride_kn, stride_vn, offs_m, offs_n, d_ok,
                   0, full_end, N_K, qk_scale, 1, IS_CAUSAL, BLOCK_N, PAD_D, USE_TMA, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_src, V_src, stride_kn, stride_vn, offs_m, offs_n, d_ok,
                   full_end, masked_end, N_K, qk_scale, 2, IS_CAUSAL, BLOCK_N, PAD_D, USE_TMA, DOT_PRECISION)

    dq = dq * sm_scale
    _store(DQ + z64 * stride_dqz + h64 * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
           dq.to(DQ.dtype.element_ty), row_ok, d_ok, PAD_D)


# ------------------------------------------------------------------------------------- launchers


def _device_guard(device):
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _tma_usable(policy: Policy, *tensors: torch.Tensor, backward: bool = False) -> bool:
    """Tensor descriptors asked for (policy.tma, or policy.tma_backward for the backward) and possible:
    Triton has them, the GPU is Hopper or newer (or the interpreter runs), and every base and leading
    stride is 16-byte aligned and non-zero."""
    if not (policy.tma_backward if backward else policy.tma) or not hasattr(tl, "make_tensor_descriptor"):
        return False
    device = tensors[0].device
    if capability(device)[0] < 9 if device.type == "cuda" else not INTERPRET:
        return False
    return all(t.data_ptr() % 16 == 0 and all(s > 0 and s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
               for t in tensors)  # s > 0: an expanded dO (stride 0) is not a descriptor the driver documents


def _tma_scratch(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)  # torch's blocks are 512-byte aligned


def _set_tma_allocator() -> None:
    """Tensor descriptors built inside a kernel need global scratch memory from Triton's allocator. Looked
    at on every launch that uses them: Triton keeps it in a ContextVar, one per thread, and autograd runs
    the backward on a thread of its own (set once and cached, the allocator of the first thread was missing
    in the other: seen on an H200 with triton 3.6). One that the user or another library set is kept."""
    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)


INTERPRETER_PROGRAMS = 4  # the persistent grid's size under the interpreter (no SMs to count)


def _persistent_programs(device) -> int:
    """Programs of the persistent forward grid: one per SM on a GPU."""
    return sm_count(device) if torch.device(device).type == "cuda" else INTERPRETER_PROGRAMS


def _tl_forward(q4, k4, v4, is_causal: bool, policy: Policy):
    """The tl forward on [Z, H, n, d] inputs: (o4, lse [Z, H, n_q] float32, what ran)."""
    (Z, H, n_q, d), n_k = q4.shape, k4.shape[2]
    o4 = plans.alloc("o", (Z, H, n_q, d), q4.dtype, q4.device)
    lse = plans.alloc("lse", (Z, H, n_q), torch.float32, q4.device)
    use_tma = _tma_usable(policy, q4, k4, v4)
    if use_tma and q4.device.type == "cuda":
        _set_tma_allocator()
    persistent = bool(policy.persistent)
    heads_fast = bool(is_causal and policy.heads_fast and max(n_q, n_k) <= MAX_FAST_ROWS)

    def grid(meta):
        if persistent:
            return (min(_persistent_programs(q4.device), _cdiv(n_q, meta["BLOCK_M"]) * H * Z),)
        return _grid(_cdiv(n_q, meta["BLOCK_M"]), H, Z, heads_fast)

    args = (q4, k4, v4, o4, lse, 1.0 / math.sqrt(d), *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3],
            *o4.stride()[:3], Z, H, H // k4.shape[1], n_q, n_k)
    warp_spec = (bool(policy.warp_specialize) and (not use_tma or policy.warp_spec_with_tma)
                 and bool(warp_spec_configs(policy.configs_for("fwd", q4.dtype), d_pad=head_dim_pad(d),
                                            elem=q4.element_size(), smem=shared_memory(q4.device))))
    consts = dict(HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad(d), IS_CAUSAL=bool(is_causal), HEADS_FAST=heads_fast,
                  DOT_PRECISION=_dot_precision(q4), USE_TMA=use_tma, WARP_SPEC=warp_spec, PERSISTENT=persistent)
    with _device_guard(q4.device):
        tiles = _launch("fwd", grid, args, consts, policy, q4, shape=(Z, H, H // k4.shape[1], n_q, n_k),
                        names=("q", "k", "v", "o", "lse"))
    return o4, lse, {"fwd": tiles}


def _preprocess(o4, do4, dq32, dq_name: str, prepare: list | None = None) -> torch.Tensor:
    """D = rowsum(dO ∘ O) [Z, H, n_q] (the one-launch backwards need it whole); zeroes their dQ `dq32` (`dq_name`)."""
    Z, H, n_q, d = o4.shape
    delta = plans.alloc("delta", (Z, H, n_q), torch.float32, o4.device)
    block = 16 if INTERPRET else 64
    grid, args = (_cdiv(n_q, block), H, Z), (o4, do4, delta, dq32, *o4.stride()[:3], *do4.stride()[:3], H, n_q)
    consts = dict(HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad(d), BLOCK_M=block)
    if prepare is not None:
        prepare.append(functools.partial(_attn_bwd_preprocess.warmup, *args, grid=grid, **consts))
    else:
        plans.launch(_attn_bwd_preprocess, grid, args, consts, ("o", "do", "delta", dq_name))
    return delta


def _tl_backward(q4, k4, v4, o4, lse3, do4, is_causal: bool, policy: Policy, prepare: list | None = None):
    """The tl backward on [Z, H, n, d] inputs: (dq4, dk4, dv4, what ran). Two atomics-free kernels (the dQ
    kernel computes D on the way); with policy.fused_backward True, their programs in one launch of the dK/dV
    kernel ("dkdv+dq", WITH_DQ); with deterministic=False one launch that adds dQ in float32. With
    `prepare` (see _launch): None, the kernels' compiles appended, nothing run (outputs are stand-ins)."""
    (Z, H, n_q, d), (H_kv, n_k) = q4.shape, k4.shape[1:3]
    atomic = policy.deterministic is False
    fused = not atomic and policy.fused_backward is True
    dq4 = plans.alloc("dq", (Z, H, n_q, d), torch.float32 if atomic else q4.dtype, q4.device)
    dk4 = plans.alloc("dk", (Z, H_kv, n_k, d), k4.dtype, q4.device)
    dv4 = plans.alloc("dv", (Z, H_kv, n_k, d), v4.dtype, q4.device)
    sm_scale = 1.0 / math.sqrt(d)
    use_tma = _tma_usable(policy, q4, k4, v4, do4, backward=True)
    if use_tma and q4.device.type == "cuda" and prepare is None:
        _set_tma_allocator()
    heads_fast = bool(is_causal and policy.heads_fast and not fused and max(n_q, n_k) <= MAX_FAST_ROWS)
    consts = dict(HEAD_DIM=d, HEAD_DIM_PAD=head_dim_pad(d), IS_CAUSAL=bool(is_causal), HEADS_FAST=heads_fast,
                  DOT_PRECISION=_dot_precision(q4), USE_TMA=use_tma)
    shapes = (H, H // H_kv, n_q, n_k)

    def grid_keys(meta):  # with the fused dQ programs after the key tiles: GROUP · query tiles of them
        return _grid(_cdiv(n_k, meta["BLOCK_N"]) + fused * (H // H_kv) * _cdiv(n_q, meta["BLOCK_M"]), H_kv, Z,
                     heads_fast)

    def grid_queries(meta):
        return _grid(_cdiv(n_q, meta["BLOCK_M"]), H, Z, heads_fast)

    ran = {}
    with _device_guard(q4.device):
        if atomic:  # D, and dQ's float32 accumulator zeroed
            delta = _preprocess(o4, do4, dq4, "dq", prepare)
        elif fused:  # every program computes the D it needs: L stands in for the Delta it never reads
            delta = lse3
        else:  # the dQ kernel computes D on the way (three launches in all at launch-bound shapes, not four)
            delta = plans.alloc("delta", (Z, H, n_q), torch.float32, q4.device)
            ran["dq"] = _launch("dq", grid_queries,
                                (q4, k4, v4, o4, do4, lse3, delta, dq4, sm_scale, *q4.stride()[:3], *k4.stride()[:3],
                                 *v4.stride()[:3], *o4.stride()[:3], *do4.stride()[:3], *dq4.stride()[:3], *shapes),
                                consts, policy, q4, shape=(Z, *shapes[:2], n_q, n_k),
                                names=("q", "k", "v", "o", "do", "lse", "delta", "dq"), prepare=prepare)
        tma_dq = atomic and use_tma and policy.tma_reduce_dq and q4.device.type == "cuda" and not INTERPRET
        ran["dkdv+dq" if fused else "dkdv"] = _launch(
            "dkdv", grid_keys, (q4, k4, v4, o4, do4, lse3, delta, dk4, dv4, dq4, sm_scale, *q4.stride()[:3],
                                *k4.stride()[:3], *v4.stride()[:3], *o4.stride()[:3], *do4.stride()[:3],
                                *dk4.stride()[:3], *dv4.stride()[:3], *dq4.stride()[:3], *shapes),
            {**consts, "ATOMIC_DQ": atomic, "TMA_DQ": tma_dq, "WITH_DQ": fused}, policy, q4,
            shape=(Z, *shapes[:2], n_q, n_k), names=("q", "k", "v", "o", "do", "lse", "lse" if fused else "delta",
                                                     "dk", "dv", "dq"),
            reset=dq4.zero_ if atomic else None, prepare=prepare)
    if prepare is not None:
        return None
    # the atomic path accumulates dQ in fp32; .to is a no-op (no copy) when the dtypes already match
    return dq4.to(q4.dtype), dk4, dv4, ran


# The names that moved to lmsys.kernels.flash, importable from here as before. Looked up on first use:
# flash imports this module, so importing it here at the top would be a cycle.
_MOVED = frozenset({
    "Policy", "DEFAULT_POLICY", "Ran", "default_policy", "launch_forward", "launch_backward", "flash_forward",
    "FlashAttentionTriton", "kernels_ran", "flash_attention", "_flash_fwd", "_flash_bwd", "_dispatch", "_gluon",
    "_gluon_forward", "_gluon_backward", "_precompile_backward", "_PRECOMPILED", "_first_call", "_first_fit",
    "_check_inputs", "_as_4d", "check_device", "check_head_dim", "_check_shared_memory", "_smallest_tiles",
})


def __getattr__(name: str):
    if name in _MOVED:
        from lmsys.kernels import flash

        return getattr(flash, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""FlashAttention-2 forward and backward as Triton kernels.

Algorithm (Dao, "FlashAttention-2", 2023; layout after Triton's 06-fused-attention tutorial):
- Forward, one program per (query tile, head): walk the key/value tiles with the online softmax in base 2
  (log2 e folded into the score scale, so each probability is one exp2), accumulate in float32, write
  O in the input dtype and the logsumexp L = m + log l (natural log, float32) for the backward.
- Backward, three launches and no atomics: D = rowsum(dO ∘ O); a dK/dV kernel, one program per key tile,
  that walks the query tiles (dV += Pᵀ dO, dK += dSᵀ Q); a dQ kernel, one program per query tile, that
  walks the key tiles (dQ += dS K). Both recompute P = exp(S - L) from L; dS = P ∘ (dP - D).
- Causal (top-left aligned: query i attends keys j <= i): tiles wholly above the diagonal are never
  visited. One inner loop per kernel serves two stages chosen at compile time: STAGE 1 walks tiles that
  are wholly visible (no index arithmetic beyond the pointer step), STAGE 2 the tiles that straddle the
  diagonal or hang past the last query/key, which build a mask. Causal programs run heaviest-first.
- Inputs [..., n, d] are viewed as [Z, H, n, d] and the kernels take strides, so transposed views
  ([B, S, H, d].transpose(1, 2)) run without a copy; a copy happens only when the leading dims cannot be
  merged or d is not the unit-stride dim.

Limits that hold today: head dim 16, 32, 64, 128, or 256 in fp16/bf16 (fp32 tiles of 256 overflow Hopper's
shared memory); fp32, fp16 and bf16 inputs (fp32 dots run as tf32x3, three TF32 tensor-core products,
near-fp32 accuracy); any n_queries and n_keys >= 1; CUDA tensors,
or CPU tensors under TRITON_INTERPRET=1 (set before this module is imported). Plain pointer loads with
masks (no block pointers, which newer Triton removed), so one source runs on triton 3.6 and the newest.
Tile sizes, warps and stages come from triton.autotune, keyed on the lengths, head dim, causality and
(implicitly) dtype; set LMSYS_FLASH_AUTOTUNE=0 to take the first config that fits instead of timing them.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager, nullcontext

import torch
import triton
import triton.language as tl

from lmsys.core.errors import LmsysError
from lmsys.kernels import triton_interpreted
from lmsys.kernels.shapes import check_qkv

HEAD_DIMS = (16, 32, 64, 128, 256)
FP32_HEAD_DIMS = (16, 32, 64, 128)  # d 256 in fp32: no tile fits in shared memory (seen on an H200)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRET = triton_interpreted()  # read by Triton when the kernels are decorated

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# Triton's interpreter multiplies bfloat16 tiles as their raw 16-bit integers (seen with triton 3.9.0):
# under it, bf16 dot operands are widened to fp32 first. Compiled kernels never take that branch.
_WIDEN_BF16_DOTS = tl.constexpr(INTERPRET)

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
def _fwd_tiles(acc, l_i, m_i, q, K_ptrs, V_ptrs, stride_kn, stride_vn, offs_m, offs_n, lo, hi, N_K, qk_scale,
               STAGE: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """Online softmax over the key tiles [lo, hi) for one query tile. K_ptrs: [HEAD_DIM, BLOCK_N] (Kᵀ)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if STAGE == 1:
            kT = tl.load(K_ptrs + start_n * stride_kn)
        else:
            key_ok = (start_n + offs_n) < N_K
            kT = tl.load(K_ptrs + start_n * stride_kn, mask=key_ok[None, :], other=0.0)
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
        if STAGE == 1:
            v = tl.load(V_ptrs + start_n * stride_vn)
        else:
            v = tl.load(V_ptrs + start_n * stride_vn, mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q_ptrs, DO_ptrs, L_ptrs, D_ptrs, stride_qm, stride_dom, offs_n, offs_m, lo, hi,
                N_Q, qk_scale, STAGE: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """dK, dV of one key tile from the query tiles [lo, hi). Q_ptrs: [HEAD_DIM, BLOCK_M] (Qᵀ)."""
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        if STAGE == 1:
            qT = tl.load(Q_ptrs + start_m * stride_qm)
            lse = tl.load(L_ptrs + start_m)
        else:
            row_ok = (start_m + offs_m) < N_Q
            qT = tl.load(Q_ptrs + start_m * stride_qm, mask=row_ok[None, :], other=0.0)
            lse = tl.load(L_ptrs + start_m, mask=row_ok, other=0.0)
        sT = _dot(k, qT, None, DOT_PRECISION) * qk_scale - lse[None, :] * _LOG2E  # [BLOCK_N, BLOCK_M], log2 P
        if STAGE == 1:
            do = tl.load(DO_ptrs + start_m * stride_dom)
            delta = tl.load(D_ptrs + start_m)
        else:
            visible = row_ok[None, :]
            if IS_CAUSAL:
                visible = visible & ((start_m + offs_m)[None, :] >= offs_n[:, None])
            sT = tl.where(visible, sT, float("-inf"))
            do = tl.load(DO_ptrs + start_m * stride_dom, mask=row_ok[:, None], other=0.0)
            delta = tl.load(D_ptrs + start_m, mask=row_ok, other=0.0)
        pT = tl.math.exp2(sT)
        dv = _dot(pT.to(do.dtype), do, dv, DOT_PRECISION)
        dpT = _dot(v, tl.trans(do), None, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        dsT = pT * (dpT - delta[None, :])
        dk = _dot(dsT.to(qT.dtype), tl.trans(qT), dk, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, K_ptrs, V_ptrs, stride_kn, stride_vn, offs_m, offs_n, lo, hi, N_K,
              qk_scale, STAGE: tl.constexpr, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """dQ of one query tile from the key tiles [lo, hi). K_ptrs, V_ptrs: [HEAD_DIM, BLOCK_N] (Kᵀ, Vᵀ)."""
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if STAGE == 1:
            kT = tl.load(K_ptrs + start_n * stride_kn)
            vT = tl.load(V_ptrs + start_n * stride_vn)
        else:
            key_ok = (start_n + offs_n) < N_K
            kT = tl.load(K_ptrs + start_n * stride_kn, mask=key_ok[None, :], other=0.0)
            vT = tl.load(V_ptrs + start_n * stride_vn, mask=key_ok[None, :], other=0.0)
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


# (BLOCK_M, BLOCK_N, warps, stages) on a GPU; without autotuning, the first that fits is taken. Chosen from
# a wider sweep on an H200 (docs/benchmarks/attention.md): the best of each kernel at d 64 and d 128, bf16,
# causal, seq 16384, then smaller tiles for fp32 and d 256.
GPU_CONFIGS = {
    "fwd": [_config(128, 64, 8, 3), _config(128, 64, 4, 3), _config(64, 64, 4, 3), _config(64, 128, 4, 3),
            _config(64, 32, 4, 2)],
    "dkdv": [_config(64, 64, 4, 3), _config(64, 128, 8, 3), _config(32, 128, 4, 3), _config(32, 64, 4, 3),
             _config(32, 32, 4, 2)],
    "dq": [_config(64, 128, 4, 3), _config(64, 64, 4, 3), _config(128, 64, 8, 3), _config(64, 32, 4, 3),
           _config(32, 32, 4, 2)],
}
# In the interpreter: one small config per kernel (nothing to time), so small test inputs span several
# tiles, with BLOCK_M != BLOCK_N both ways round.
INTERPRETER_CONFIGS = {"fwd": [_config(32, 16, 4, 1)], "dkdv": [_config(16, 32, 4, 1)], "dq": [_config(32, 16, 4, 1)]}
CONFIGS = INTERPRETER_CONFIGS if INTERPRET else GPU_CONFIGS

SMEM_BYTES = 232448  # shared memory one block may use on Hopper (H100, H200): 227 KiB
ACC_PER_THREAD = 128  # float32 accumulator registers per thread above which the kernel spills


def _tile_budget(kernel: str):
    """(accumulator floats, shared-memory bytes) of a config for one kernel, as a function of the tiles.
    The probability tile that feeds the second product is staged too, twice for fp32 (tf32x3 splits it
    into high and low parts): so counted, the estimate matched what triton 3.6 asked for at d 128 in fp32
    on an H200. At d 256 in fp32 it asked for more than any config's estimate: hence FP32_HEAD_DIMS."""

    def staged_p(bm, bn, elem):
        return bm * bn * (2 if elem == 4 else 1)

    def fwd(bm, bn, d, stages, elem):  # acc [BM, d]; q resident, k and v pipelined, p staged
        return bm * d, elem * (bm * d + stages * 2 * bn * d + staged_p(bm, bn, elem))

    def dkdv(bm, bn, d, stages, elem):  # dk, dv [BN, d]; k, v resident, q and dO pipelined, pᵀ and dsᵀ staged
        return 2 * bn * d, elem * (2 * bn * d + stages * 2 * bm * d + 2 * staged_p(bm, bn, elem))

    def dq(bm, bn, d, stages, elem):  # dq [BM, d]; q, dO resident, k and v pipelined, ds staged
        return bm * d, elem * (2 * bm * d + stages * 2 * bn * d + staged_p(bm, bn, elem))

    return {"fwd": fwd, "dkdv": dkdv, "dq": dq}[kernel]


def _prune_by_head_dim(kernel: str):
    """The named filter for triton.autotune: drop configs whose accumulators would spill or whose tiles
    overflow shared memory at this head dim and element size (always keeps at least one)."""
    budget = _tile_budget(kernel)

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        d, elem = args["HEAD_DIM"], args["Q"].element_size()
        cost = {}
        for c in configs:
            acc, smem = budget(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], d, c.num_stages, elem)
            cost[c] = (acc / (32 * c.num_warps), smem)
        kept = [c for c in configs if cost[c][0] <= ACC_PER_THREAD and cost[c][1] <= SMEM_BYTES]
        kept = kept or [min(configs, key=lambda c: (cost[c][1], cost[c][0]))]
        if _rotation is not None:
            kept = [kept[_rotation % len(kept)]]
        elif os.environ.get("LMSYS_FLASH_AUTOTUNE", "1") == "0":
            kept = kept[:1]
        return kept

    return prune


_rotation: int | None = None


def _tuners() -> dict:
    """The three autotuned kernels by name (defined below)."""
    return {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}


@contextmanager
def rotate_configs(index: int):
    """Inside: each kernel runs, untimed, its `index`-th config that fits (modulo how many fit), for keys
    it has not cached yet. `flash check` passes the case number, so N cases exercise every tile shape
    with one compile per kernel each, instead of compiling and timing them all for every new shape.
    Keys cached inside are dropped on the way out: later calls with those shapes autotune as usual."""
    global _rotation
    tuners = list(_tuners().values())
    before = [set(t.cache) for t in tuners]
    _rotation, previous = index, _rotation
    try:
        yield
    finally:
        _rotation = previous
        for tuner, keys in zip(tuners, before):
            for key in set(tuner.cache) - keys:
                del tuner.cache[key]


def tiles_used(kernel: str) -> str:
    """BLOCK_M×BLOCK_N of the config `kernel` ("fwd", "dkdv", "dq") last ran with."""
    config = getattr(_tuners()[kernel], "best_config", None)
    return "—" if config is None else f"{config.kwargs['BLOCK_M']}×{config.kwargs['BLOCK_N']}"


_AUTOTUNE_KEY = ["N_Q", "N_K", "HEAD_DIM", "IS_CAUSAL"]  # the dtype of the tensors is keyed by Triton itself

# --------------------------------------------------------------------------------------- forward


@triton.autotune(configs=CONFIGS["fwd"], key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_by_head_dim("fwd")})
@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_fwd(Q, K, V, O, L, sm_scale,
              stride_qz, stride_qh, stride_qm,
              stride_kz, stride_kh, stride_kn,
              stride_vz, stride_vh, stride_vn,
              stride_oz, stride_oh, stride_om,
              H, N_Q, N_K,
              HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # the last query tiles see the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    off_zh = (off_z * H + off_h).to(tl.int64)
    q_base = Q + off_z.to(tl.int64) * stride_qz + off_h.to(tl.int64) * stride_qh
    k_base = K + off_z.to(tl.int64) * stride_kz + off_h.to(tl.int64) * stride_kh
    v_base = V + off_z.to(tl.int64) * stride_vz + off_h.to(tl.int64) * stride_vh
    o_base = O + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_Q
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    K_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None]
    V_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E

    n_k_full = (N_K // BLOCK_N) * BLOCK_N  # key tiles wholly inside the sequence
    if IS_CAUSAL:
        full_end = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, n_k_full)  # tiles wholly below the diagonal
        masked_end = tl.minimum(start_m + BLOCK_M, N_K)  # later tiles are wholly above it: never visited
    else:
        full_end = n_k_full
        masked_end = N_K
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_ptrs, V_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                               0, full_end, N_K, qk_scale, 1, IS_CAUSAL, BLOCK_N, DOT_PRECISION)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, K_ptrs, V_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                               full_end, masked_end, N_K, qk_scale, 2, IS_CAUSAL, BLOCK_N, DOT_PRECISION)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * _LN2  # natural-log logsumexp of the scaled scores
    tl.store(L + off_zh * N_Q + offs_m, lse, mask=row_ok)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None])


# -------------------------------------------------------------------------------------- backward


@triton.jit(do_not_specialize=["N_Q"])
def _attn_bwd_preprocess(O, DO, Delta,
                         stride_oz, stride_oh, stride_om,
                         stride_doz, stride_doh, stride_dom,
                         H, N_Q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO ∘ O), float32 [Z, H, N_Q]."""
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_Q
    o = tl.load(O + off_z.to(tl.int64) * stride_oz + off_h.to(tl.int64) * stride_oh
                + offs_m[:, None] * stride_om + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + off_z.to(tl.int64) * stride_doz + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None] * stride_dom + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + (off_z * H + off_h).to(tl.int64) * N_Q + offs_m, delta, mask=row_ok)


@triton.autotune(configs=CONFIGS["dkdv"], key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_by_head_dim("dkdv")})
@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_bwd_dkdv(Q, K, V, DO, L, Delta, DK, DV, sm_scale,
                   stride_qz, stride_qh, stride_qm,
                   stride_kz, stride_kh, stride_kn,
                   stride_vz, stride_vh, stride_vn,
                   stride_doz, stride_doh, stride_dom,
                   stride_dkz, stride_dkh, stride_dkn,
                   stride_dvz, stride_dvh, stride_dvn,
                   H, N_Q, N_K,
                   HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per key tile: walks the query tiles that see it (no atomics: it owns its dK, dV rows)."""
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    off_zh = (off_z * H + off_h).to(tl.int64)
    z64, h64 = off_z.to(tl.int64), off_h.to(tl.int64)
    q_base = Q + z64 * stride_qz + h64 * stride_qh
    k_base = K + z64 * stride_kz + h64 * stride_kh
    v_base = V + z64 * stride_vz + h64 * stride_vh
    do_base = DO + z64 * stride_doz + h64 * stride_doh

    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < N_K
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    Q_ptrs = q_base + offs_m[None, :] * stride_qm + offs_d[:, None]
    DO_ptrs = do_base + offs_m[:, None] * stride_dom + offs_d[None, :]
    L_ptrs = L + off_zh * N_Q + offs_m
    D_ptrs = Delta + off_zh * N_Q + offs_m

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    n_q_full = (N_Q // BLOCK_M) * BLOCK_M  # query tiles wholly inside the sequence
    if IS_CAUSAL:
        first = (start_n // BLOCK_M) * BLOCK_M  # earlier query tiles see none of these keys
        diag_end = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M  # from here every query sees every key
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_ptrs, DO_ptrs, L_ptrs, D_ptrs, stride_qm, stride_dom, offs_n, offs_m,
                             first, tl.minimum(diag_end, N_Q), N_Q, qk_scale, 2, IS_CAUSAL, BLOCK_M, DOT_PRECISION)
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_ptrs, DO_ptrs, L_ptrs, D_ptrs, stride_qm, stride_dom, offs_n, offs_m,
                             diag_end, n_q_full, N_Q, qk_scale, 1, IS_CAUSAL, BLOCK_M, DOT_PRECISION)
        edge = tl.maximum(diag_end, n_q_full)
    else:
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q_ptrs, DO_ptrs, L_ptrs, D_ptrs, stride_qm, stride_dom, offs_n, offs_m,
                             0, n_q_full, N_Q, qk_scale, 1, IS_CAUSAL, BLOCK_M, DOT_PRECISION)
        edge = n_q_full
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q_ptrs, DO_ptrs, L_ptrs, D_ptrs, stride_qm, stride_dom, offs_n, offs_m,
                         edge, N_Q, N_Q, qk_scale, 2, IS_CAUSAL, BLOCK_M, DOT_PRECISION)

    dk = dk * sm_scale
    tl.store(DK + z64 * stride_dkz + h64 * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + z64 * stride_dvz + h64 * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.autotune(configs=CONFIGS["dq"], key=_AUTOTUNE_KEY, prune_configs_by={"early_config_prune": _prune_by_head_dim("dq")})
@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _attn_bwd_dq(Q, K, V, DO, L, Delta, DQ, sm_scale,
                 stride_qz, stride_qh, stride_qm,
                 stride_kz, stride_kh, stride_kn,
                 stride_vz, stride_vh, stride_vn,
                 stride_doz, stride_doh, stride_dom,
                 stride_dqz, stride_dqh, stride_dqm,
                 H, N_Q, N_K,
                 HEAD_DIM: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per query tile: walks the key tiles it sees (it owns its dQ rows)."""
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    off_zh = (off_z * H + off_h).to(tl.int64)
    z64, h64 = off_z.to(tl.int64), off_h.to(tl.int64)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_Q
    q = tl.load(Q + z64 * stride_qz + h64 * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + z64 * stride_doz + h64 * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(L + off_zh * N_Q + offs_m, mask=row_ok, other=0.0) * _LOG2E
    delta = tl.load(Delta + off_zh * N_Q + offs_m, mask=row_ok, other=0.0)
    K_ptrs = K + z64 * stride_kz + h64 * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None]
    V_ptrs = V + z64 * stride_vz + h64 * stride_vh + offs_n[None, :] * stride_vn + offs_d[:, None]

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    n_k_full = (N_K // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_end = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, n_k_full)
        masked_end = tl.minimum(start_m + BLOCK_M, N_K)
    else:
        full_end = n_k_full
        masked_end = N_K
    dq = _dq_tiles(dq, q, do, lse2, delta, K_ptrs, V_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                   0, full_end, N_K, qk_scale, 1, IS_CAUSAL, BLOCK_N, DOT_PRECISION)
    dq = _dq_tiles(dq, q, do, lse2, delta, K_ptrs, V_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                   full_end, masked_end, N_K, qk_scale, 2, IS_CAUSAL, BLOCK_N, DOT_PRECISION)

    dq = dq * sm_scale
    tl.store(DQ + z64 * stride_dqz + h64 * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ------------------------------------------------------------------------------------- launchers


def check_device(device) -> None:
    """CUDA, or any device when Triton's interpreter is on; otherwise point at flash-torch."""
    if torch.device(device).type != "cuda" and not INTERPRET:
        raise LmsysError(
            f"flash-triton needs CUDA tensors (got {torch.device(device).type}); use flash-torch on a CPU",
            hint="or set TRITON_INTERPRET=1 before lmsys is imported to run the Triton kernels in its interpreter",
        )


def check_head_dim(d: int) -> None:
    """The head dims the kernels are built for (fp32 narrows them further: see _check_inputs)."""
    if d not in HEAD_DIMS:
        raise LmsysError(f"flash-triton: head dim {d} is not supported (supported: "
                         f"{', '.join(map(str, HEAD_DIMS))})", hint="use flash-torch or sdpa for other head dims")


def _check_inputs(q, k, v) -> None:
    # shape constraints
    check_qkv(q, k, v, impl="flash-triton")
    check_head_dim(q.shape[-1])
    if q.dtype not in DTYPES:
        raise LmsysError(f"flash-triton: dtype {q.dtype} is not supported (float32, float16, bfloat16)")
    if q.dtype == torch.float32 and q.shape[-1] not in FP32_HEAD_DIMS:
        raise LmsysError(f"flash-triton: head dim {q.shape[-1]} needs fp16 or bf16 inputs (in fp32 its tiles do not "
                         f"fit in shared memory; fp32 supports {', '.join(map(str, FP32_HEAD_DIMS))})",
                         hint="cast to bf16, or use flash-torch or sdpa")
    check_device(q.device)


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """[..., n, d] -> [Z, H, n, d] with unit stride along d: a view when the strides allow it."""
    if x.dim() == 2:
        x = x[None, None]
    elif x.dim() == 3:
        x = x[None]
    elif x.dim() > 4:
        x = x.reshape(-1, *x.shape[-3:])
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _dot_precision(dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "tf32"  # the latter is ignored for 16-bit inputs


def _device_guard(device):
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def flash_forward(q, k, v, is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [..., n_q, d] in q's dtype, L [..., n_q] float32)."""
    _check_inputs(q, k, v)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    Z, H, n_q, d = q4.shape
    n_k = k4.shape[2]
    o4 = torch.empty((Z, H, n_q, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((Z, H, n_q), dtype=torch.float32, device=q.device)

    def grid(meta):
        return (triton.cdiv(n_q, meta["BLOCK_M"]), H, Z)

    with _device_guard(q.device):
        _attn_fwd[grid](q4, k4, v4, o4, lse, 1.0 / math.sqrt(d),
                        *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o4.stride()[:3],
                        H, n_q, n_k, HEAD_DIM=d, IS_CAUSAL=bool(is_causal), DOT_PRECISION=_dot_precision(q.dtype))
    return o4.view(q.shape), lse.view(q.shape[:-1])


def flash_backward(q, k, v, o, lse, do, is_causal: bool = False):
    """(dq, dk, dv) in the inputs' dtypes, from the saved L and D = rowsum(dO ∘ O)."""
    q4, k4, v4, o4, do4 = _as_4d(q), _as_4d(k), _as_4d(v), _as_4d(o), _as_4d(do)
    Z, H, n_q, d = q4.shape
    n_k = k4.shape[2]
    lse3 = lse.reshape(Z, H, n_q)
    if lse3.stride() != (H * n_q, n_q, 1):
        lse3 = lse3.contiguous()
    delta = torch.empty((Z, H, n_q), dtype=torch.float32, device=q.device)
    dq4 = torch.empty((Z, H, n_q, d), dtype=q.dtype, device=q.device)
    dk4 = torch.empty((Z, H, n_k, d), dtype=k.dtype, device=q.device)
    dv4 = torch.empty((Z, H, n_k, d), dtype=v.dtype, device=q.device)
    sm_scale, precision = 1.0 / math.sqrt(d), _dot_precision(q.dtype)
    pre_block = 16 if INTERPRET else 64

    def grid_keys(meta):
        return (triton.cdiv(n_k, meta["BLOCK_N"]), H, Z)

    def grid_queries(meta):
        return (triton.cdiv(n_q, meta["BLOCK_M"]), H, Z)

    with _device_guard(q.device):
        _attn_bwd_preprocess[(triton.cdiv(n_q, pre_block), H, Z)](
            o4, do4, delta, *o4.stride()[:3], *do4.stride()[:3], H, n_q, HEAD_DIM=d, BLOCK_M=pre_block)
        _attn_bwd_dkdv[grid_keys](
            q4, k4, v4, do4, lse3, delta, dk4, dv4, sm_scale,
            *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *do4.stride()[:3], *dk4.stride()[:3],
            *dv4.stride()[:3], H, n_q, n_k, HEAD_DIM=d, IS_CAUSAL=bool(is_causal), DOT_PRECISION=precision)
        _attn_bwd_dq[grid_queries](
            q4, k4, v4, do4, lse3, delta, dq4, sm_scale,
            *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *do4.stride()[:3], *dq4.stride()[:3],
            H, n_q, n_k, HEAD_DIM=d, IS_CAUSAL=bool(is_causal), DOT_PRECISION=precision)
    return dq4.view(q.shape), dk4.view(k.shape), dv4.view(v.shape)


# ------------------------------------------------------------------------------ autograd.Function


class FlashAttentionTriton(torch.autograd.Function):
    """`FlashAttentionTriton.apply(q, k, v, is_causal=False)`: q [..., n_q, d], k and v [..., n_k, d].

    Saves q, k, v, o and L (float32, shape q.shape[:-1]) for the backward pass, nothing else."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = flash_forward(q, k, v, bool(is_causal))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal)
        return dq, dk, dv, None


flash_attention = FlashAttentionTriton.apply

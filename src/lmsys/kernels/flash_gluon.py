"""FlashAttention's forward in Gluon for Hopper (H100/H200): the warp roles triton.language cannot say.

triton.language leaves the warp roles to its compiler; Gluon (triton.experimental.gluon, in the same
triton wheel) lets the kernel say them, with a register budget per role (setmaxnreg underneath):

- a load partition, one warp with 24 registers, brings Q once and K, V tiles through a ring of STAGES
  shared buffers by TMA, with ready/empty mbarriers (K and V on separate ready barriers, so QKᵀ starts
  before V has landed);
- the compute partition (the default one: one or two warp groups, 64 query rows each) runs both products
  as asynchronous wgmma and the online softmax in registers, the products under the exponentials:
  PIPELINE 1 issues the next tile's QKᵀ before this tile's exponentials; PIPELINE 2 is FlashAttention-3's
  order, QKᵀ of tile j and PV of tile j-1 issued together and the softmax of tile j under both.

It computes what `flash_triton._attn_fwd` computes (O, and L = the natural-log logsumexp that the
backward reads) for the shapes `usable` accepts; `flash_triton.flash_forward` runs it there when the
policy asks (`Policy.gluon`) and the tl kernel everywhere else. Measured against the tl forward and
cuDNN in docs/benchmarks/attention.md; scripts/gpu/gluon_attention.py sweeps its configs, and compiles
them for sm_90 on a machine without a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lmsys.core.devices import capability

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Config:
    """One launch configuration: tiles, K/V ring depth, where the products overlap the softmax (PIPELINE),
    warps of the compute partition, and maxnreg (registers per thread at launch; the load warp gives its
    share to the compute partition)."""

    block_m: int
    block_n: int
    stages: int
    pipeline: int
    warps: int
    maxnreg: int

    def __post_init__(self):
        if self.block_m != 16 * self.warps:  # one m64 wgmma per warp group of four warps
            raise ValueError(f"block_m {self.block_m} needs {self.block_m // 16} warps, not {self.warps}")
        if self.pipeline not in (0, 1, 2) or self.stages < (2 if self.pipeline else 1):
            # pipelined, the compute partition holds tile j's slot while it waits for tile j+1's K
            raise ValueError(f"pipeline {self.pipeline} with {self.stages} stages")
        if max(self.block_m, self.block_n) % min(self.block_m, self.block_n):
            raise ValueError("one tile must divide the other (the causal diagonal's tiles)")


# The head dims the kernel runs by default, with the fastest config of scripts/gpu/gluon_attention.py's sweep
# at the leaderboard shape (H200, triton 3.6), as a multiple of the tl forward's time in the same run
# (docs/benchmarks/attention.md): d 128, two warp groups with the next QKᵀ under the softmax, 0.915-0.968x
# in nine runs. D64_CONFIG, one warp group per CTA (two CTAs per SM) in FlashAttention-3's order, ran
# 0.908-1.031x (median 0.957) with no faster forward+backward, and its K/V ring has not yet wrapped in a
# GPU check: asked for by name (the probe, the tests) until it has.
CONFIGS = {128: Config(128, 128, 3, 1, 8, 168)}
D64_CONFIG = Config(64, 128, 3, 2, 4, 128)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
# Gluon's API moves between triton releases (3.5's warp_specialize takes other arguments; 3.9 renamed the
# TMA copies): the kernel runs only with the release it was written and measured with.
TRITON_RELEASES = ("3.6",)
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension: batch·heads here


def available() -> bool:
    """Whether the installed triton is one this kernel was written for."""
    return ".".join(triton.__version__.split(".")[:2]) in TRITON_RELEASES


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                    q_row, kv_row, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for j in range(n_tiles):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(kv_empty.index(s), phase ^ 1)  # barriers start with phase 1 complete: no wait at first
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _scores(s_acc, m_i, qk_scale, start_m, start_n, MASK: gl.constexpr, s_layout: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One tile's scores in log2 units (masked on the diagonal), the new running max and the factor
    alpha that rescales what came before."""
    s = s_acc * qk_scale
    if MASK:
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(rows[:, None] >= cols[None, :], s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    return s, m_new, gl.exp2(m_i - m_new)


@gluon.jit
def _softmax(s_acc, m_i, l_i, qk_scale, start_m, j, n_full, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
             p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DTYPE: gl.constexpr):
    """P_j (bf16, as the A operand of the PV product), the new running max and sum, and alpha."""
    if CAUSAL and j >= n_full:
        s, m_new, alpha = _scores(s_acc, m_i, qk_scale, start_m, j * BLOCK_N, True, s_layout, BLOCK_M, BLOCK_N)
    else:
        s, m_new, alpha = _scores(s_acc, m_i, qk_scale, start_m, j * BLOCK_N, False, s_layout, BLOCK_M, BLOCK_N)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return gl.convert_layout(p.to(DTYPE), p_layout), m_new, l_i, alpha


@gluon.jit
def _step(j, s_acc, m_i, l_i, o_acc, q_smem, k_smem, v_smem, k_ready, v_ready, kv_empty, s_zero, qk_scale, start_m,
          n_full, CAUSAL: gl.constexpr, NEXT: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
          o_layout: gl.constexpr, p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Key tile j, its scores S_j (s_acc) done: softmax, then O += P V_j. With NEXT, S_{j+1} is issued once O
    is rescaled (no product in flight then) and runs under the exponentials; it is returned as s_acc."""
    st = j % STAGES
    if CAUSAL and j >= n_full:
        s, m_new, alpha = _scores(s_acc, m_i, qk_scale, start_m, j * BLOCK_N, True, s_layout, BLOCK_M, BLOCK_N)
    else:
        s, m_new, alpha = _scores(s_acc, m_i, qk_scale, start_m, j * BLOCK_N, False, s_layout, BLOCK_M, BLOCK_N)
    o_acc = o_acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    if NEXT:
        nxt = j + 1
        mbarrier.wait(k_ready.index(nxt % STAGES), (nxt // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
    mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(st), o_acc, is_async=True)
    if NEXT:
        s_acc, o_acc = warpgroup_mma_wait(0, deps=[s_tok, o_tok])
    else:
        o_acc = warpgroup_mma_wait(0, deps=[o_tok])
    mbarrier.arrive(kv_empty.index(st), count=1)
    return s_acc, m_new, l_i, o_acc


@gluon.jit
def _compute_partition(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, O, L, o_row, n_full, n_tiles,
                       start_m, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, PIPELINE: gl.constexpr,
                       num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    o_acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)

    if PIPELINE == 2:
        # FlashAttention-3's order: S_j and O += P_{j-1} V_{j-1} issued together; the softmax of S_j runs
        # while the PV product is in flight; O is rescaled once it lands.
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_acc = warpgroup_mma_wait(0, deps=[s_tok])
        p_op, m_i, l_i, alpha = _softmax(s_acc, m_i, l_i, qk_scale, start_m, 0, n_full, CAUSAL, s_layout, p_layout,
                                         BLOCK_M, BLOCK_N, dtype)
        for j in range(1, n_tiles):
            st = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), o_acc, is_async=True)
            s_acc = warpgroup_mma_wait(1, deps=[s_tok])
            p_op, m_i, l_i, alpha = _softmax(s_acc, m_i, l_i, qk_scale, start_m, j, n_full, CAUSAL, s_layout,
                                             p_layout, BLOCK_M, BLOCK_N, dtype)
            o_acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(kv_empty.index(prev), count=1)
            o_acc = o_acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        last = n_tiles - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(last % STAGES), o_acc, is_async=True)
        o_acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(kv_empty.index(last % STAGES), count=1)
    elif PIPELINE:
        # S_0 first; every step but the last issues S_{j+1} before its exponentials. The last step is
        # peeled off: a wait inside a runtime branch makes triton copy the in-flight accumulator before
        # waiting, and ptxas then serialises every wgmma of the kernel (C7514).
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_acc = warpgroup_mma_wait(0, deps=[s_tok])
        for j in range(n_tiles - 1):
            s_acc, m_i, l_i, o_acc = _step(j, s_acc, m_i, l_i, o_acc, q_smem, k_smem, v_smem, k_ready, v_ready,
                                           kv_empty, s_zero, qk_scale, start_m, n_full, CAUSAL, True, STAGES,
                                           s_layout, o_layout, p_layout, BLOCK_M, BLOCK_N)
        s_acc, m_i, l_i, o_acc = _step(n_tiles - 1, s_acc, m_i, l_i, o_acc, q_smem, k_smem, v_smem, k_ready,
                                       v_ready, kv_empty, s_zero, qk_scale, start_m, n_full, CAUSAL, False, STAGES,
                                       s_layout, o_layout, p_layout, BLOCK_M, BLOCK_N)
    else:
        for j in range(n_tiles):
            mbarrier.wait(k_ready.index(j % STAGES), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            s_acc = warpgroup_mma_wait(0, deps=[s_tok])
            s_acc, m_i, l_i, o_acc = _step(j, s_acc, m_i, l_i, o_acc, q_smem, k_smem, v_smem, k_ready, v_ready,
                                           kv_empty, s_zero, qk_scale, start_m, n_full, CAUSAL, False, STAGES,
                                           s_layout, o_layout, p_layout, BLOCK_M, BLOCK_N)

    # O = acc / l; L = natural-log logsumexp of the scaled scores
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = o_acc / l_o[:, None]
    rows = o_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + rows.to(gl.int64)[:, None] * HEAD_DIM + cols[None, :], o.to(dtype))
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    l_rows = o_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    gl.store(L + l_rows, lse)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """The mbarriers between a load partition and its consumer, initialised: one for the tiles loaded once,
    and for each of the ring's STAGES slots, the ready barriers of its two tiles and its empty barrier."""
    once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(once, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_a.index(i), count=1)
        mbarrier.init(ready_b.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    return once, ready_a, ready_b, empty


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, O, L, qk_scale, N_CTX, H, GROUP,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, PIPELINE: gl.constexpr, num_warps: gl.constexpr):
    """One program per (query tile, batch·query head), heaviest causal tiles first; q, O as [Z·H·N, d],
    k, v as [Z·(H/GROUP)·N, d]."""
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    zh = gl.program_id(1)
    start_m = pid_m * BLOCK_M
    row0 = zh * N_CTX
    kv_row0 = ((zh // H) * (H // GROUP) + (zh % H) // GROUP) * N_CTX  # this query head's key/value head
    if CAUSAL:
        n_tiles = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
        n_full = (start_m + 1) // BLOCK_N  # tiles wholly at or below the diagonal need no mask
    else:
        n_tiles = N_CTX // BLOCK_N
        n_full = n_tiles

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar, k_ready, v_ready, kv_empty = ring_barriers(STAGES)

    gl.warp_specialize([
        (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, O, L, row0 + start_m,
                              n_full, n_tiles, start_m, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                              PIPELINE, num_warps)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                           row0 + start_m, kv_row0, n_tiles, BLOCK_N, STAGES)),
    ], [1], [24])


def descriptors(q, k, v, block_m: int, block_n: int):
    """TMA descriptors over q, k, v seen as [rows, d] (rows = batch·heads·sequence)."""
    d = q.shape[-1]
    gdt = DTYPES[q.dtype]
    q_desc = TensorDescriptor.from_tensor(q.reshape(-1, d), [block_m, d],
                                          gl.NVMMASharedLayout.get_default_for([block_m, d], gdt))
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    return (q_desc, TensorDescriptor.from_tensor(k.reshape(-1, d), [block_n, d], kv_layout),
            TensorDescriptor.from_tensor(v.reshape(-1, d), [block_n, d], kv_layout))


def supports(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, config: Config | None = None) -> bool:
    """Whether the kernel computes these [Z, H, N, d] inputs (device aside) with `config` (by default
    CONFIGS' for their head dim): bf16/fp16 alike, d 64 or 128,
    as many keys as queries and a multiple of the tiles (TMA reads whole tiles, across heads otherwise),
    contiguous and 16-byte aligned, query heads a multiple of key/value heads, not empty, and at most
    MAX_GRID_Y batch·heads."""
    d, n = q4.shape[-1], q4.shape[-2]
    config = config or CONFIGS.get(d)
    return (config is not None and d in (64, 128) and q4.dim() == 4 and q4.numel() > 0
            and q4.shape[0] * q4.shape[1] <= MAX_GRID_Y and q4.dtype in DTYPES
            and k4.dtype == q4.dtype and v4.dtype == q4.dtype
            and k4.shape[-2] == n and k4.shape[-1] == d and v4.shape == k4.shape
            and k4.shape[0] == q4.shape[0] and q4.shape[1] % k4.shape[1] == 0
            and n % config.block_m == 0 and n % config.block_n == 0
            and all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (q4, k4, v4)))


def usable(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, config: Config | None = None) -> bool:
    """`supports` on an NVIDIA Hopper GPU (the kernel's wgmma and setmaxnreg are sm_90's; a ROCm build
    reports its own capabilities through the same call)."""
    return (q4.is_cuda and torch.version.hip is None and capability(q4.device)[0] == 9
            and supports(q4, k4, v4, config))


def forward(q4, k4, v4, o4, lse, is_causal: bool, config: Config | None = None) -> str:
    """Fill o4 [Z, H, N, d] and lse [Z, H, N] (float32) for inputs `usable` accepted; the tiles it ran."""
    Z, H, n, d = q4.shape
    c = config or CONFIGS[d]
    q_desc, k_desc, v_desc = descriptors(q4, k4, v4, c.block_m, c.block_n)
    _attn_fwd_ws[(n // c.block_m, Z * H)](q_desc, k_desc, v_desc, o4, lse, LOG2E / math.sqrt(d), n, H,
                                          H // k4.shape[1], BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_DIM=d,
                                          STAGES=c.stages, CAUSAL=bool(is_causal), PIPELINE=c.pipeline,
                                          num_warps=c.warps, maxnreg=c.maxnreg)
    return f"gluon {c.block_m}×{c.block_n}"

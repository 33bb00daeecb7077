"""FlashAttention's forward and backward in Gluon for Hopper (H100/H200): the warp roles triton.language
cannot say (a TMA load warp feeding compute warp groups that run asynchronous wgmma under the softmax;
FlashAttention-3's one-launch backward, dQ by TMA reduce-adds). How they work and where their configs come
from: docs/kernels.md.

Limits (`usable`, `usable_backward`): an NVIDIA sm_90 GPU and the triton release the kernels were written
for (TRITON_RELEASES); bf16/fp16; d 64 or 128; as many keys as queries, a multiple of the tiles; contiguous,
16-byte aligned [Z, H, N, d] inputs; query heads a multiple of key/value heads. The backward is not bitwise
reproducible. `lmsys.kernels.flash`'s dispatcher runs these kernels where its Policy asks and they
take the inputs, the tl kernels everywhere else.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lmsys.core.devices import capability, sm_count
from lmsys.kernels import plans

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Config:
    """One launch configuration: tiles, K/V ring depth, where the products overlap the softmax (PIPELINE),
    warps computing, maxnreg (registers per thread at launch; the load warp gives its share to the compute
    warps), and consumers: 1, one compute partition of all the warps; 2, a partition per warp group, each
    with its own half of the query tile and the K/V ring shared, so that one's softmax runs beside the
    other's products instead of in lockstep (FlashAttention-3's two consumer warp groups)."""

    block_m: int
    block_n: int
    stages: int
    pipeline: int
    warps: int
    maxnreg: int
    consumers: int = 1

    def __post_init__(self):
        if self.block_m != 16 * self.warps:  # one m64 wgmma per warp group of four warps
            raise ValueError(f"block_m {self.block_m} needs {self.block_m // 16} warps, not {self.warps}")
        if self.consumers not in (1, 2) or self.consumers == 2 and self.warps != 8:
            raise ValueError(f"{self.consumers} consumers of {self.warps} warps: 1, or 2 of one warp group each")
        if self.consumers == 2 and self.maxnreg != 168:
            # the worker consumer takes 240 registers and the load warp 24 (_attn_fwd_ws); the default
            # consumer gets the rest, 3·maxnreg - 264: 240 at 168, fewer (spills) below, no launch above
            raise ValueError(f"2 consumers need maxnreg 168 (240 registers each), not {self.maxnreg}")
        if self.pipeline not in (0, 1, 2) or self.stages < (2 if self.pipeline else 1):
            # pipelined, the compute partition holds tile j's slot while it waits for tile j+1's K
            raise ValueError(f"pipeline {self.pipeline} with {self.stages} stages")
        if max(self.block_m, self.block_n) % min(self.block_m, self.block_n):
            raise ValueError("one tile must divide the other (the causal diagonal's tiles)")


# The head dims the kernels take: 64 and 128 (tuned at the leaderboard shape), and 16 and 32 on d 64's tiles
# (an H100, b8 h1 bf16, fwd+bwd against the tl kernels: faster not causal from 8,192 keys and causal at 16,384,
# slower causal at 8,192; flash.Policy.gluon_small_min_keys decides; docs/benchmarks/attention.md).
HEAD_DIMS = (16, 32, 64, 128)
# The forward's config per head dim: the fastest of a sweep at the leaderboard shape (docs/kernels.md).
CONFIGS = {d: Config(128, 128, 3, 2, 8, 168, 2) for d in HEAD_DIMS}


@dataclass(frozen=True)
class BwdConfig:
    """The backward's launch configuration: BLOCK_M query rows per step (64 or 128: an m64 per warp group
    for the dQ tile), BLOCK_N keys per program (16 per warp of the compute partition), the Q/dO ring's
    depth, maxnreg (registers per thread at launch, for whole warp groups: the load warp's rounds up
    to one), and early_dp: dPᵀ = V·dOᵀ issued beside Sᵀ, to run under the exponentials (FlashAttention-3's
    order), else after them beside dV."""

    block_m: int
    block_n: int
    stages: int
    warps: int
    maxnreg: int
    early_dp: bool = False

    def __post_init__(self):
        if (self.block_m not in (64, 128) or self.warps % 4 or (self.warps // 4) % (self.block_m // 64)
                or self.block_n != 16 * self.warps or self.stages < 1):
            raise ValueError(f"backward tiles {self.block_m}×{self.block_n} with {self.warps} warps, "
                             f"{self.stages} stages: needs 64 or 128 (an m64 per warp group) × 16·warps "
                             "and a stage")
        if self.maxnreg * 128 * (self.warps // 4 + 1) > 65536:
            raise ValueError(f"maxnreg {self.maxnreg} does not fit {self.warps} + 4 warps in the register file")


# The backward's config per head dim (docs/kernels.md).
BWD_CONFIGS = {d: BwdConfig(64, 128, 2, 8, 168, early_dp=True) for d in HEAD_DIMS}
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
# Gluon's API moves between triton releases (3.5's warp_specialize takes other arguments; 3.9 renamed the
# TMA copies): the kernel runs only with the release it was written and measured with.
TRITON_RELEASES = ("3.6",)
MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension: batch·heads, or heads-fast the tiles


def available() -> bool:
    """Whether the installed triton is one this kernel was written for."""
    return ".".join(triton.__version__.split(".")[:2]) in TRITON_RELEASES


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                    q_row, kv_row, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """Q once (a part per consumer), then K and V of each key tile through the ring."""
    mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [q_row + c * q_desc.block_type.shape[0], 0], q_bar,
                                        q_smem.index(c))
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
    """One tile's raw scores (masked on the diagonal), the new running max in log2 units and the factor
    alpha that rescales what came before. The scale is applied to the row max only (it is positive, so
    it commutes with max): the exponent s·scale − m is then one FFMA per element, not FMUL + FADD."""
    s = s_acc
    if MASK:
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(rows[:, None] >= cols[None, :], s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    return s, m_new, gl.exp2(m_i - m_new)


@gluon.jit
def _softmax(s_acc, m_i, l_i, qk_scale, start_m, j, n_full, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
             p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DTYPE: gl.constexpr):
    """P_j (bf16, as the A operand of the PV product), the new running max and sum, and alpha."""
    if CAUSAL and j >= n_full:
        s, m_new, alpha = _scores(s_acc, m_i, qk_scale, start_m, j * BLOCK_N, True, s_layout, BLOCK_M, BLOCK_N)
    else:
        s, m_new, alpha = _scores(s_acc, m_i, qk_scale, start_m, j * BLOCK_N, False, s_layout, BLOCK_M, BLOCK_N)
    p = gl.exp2(gl.fma(s, qk_scale, -m_new[:, None]))
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
    p = gl.exp2(gl.fma(s, qk_scale, -m_new[:, None]))
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
def _compute_partition(q_parts, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, O, L, row0, n_tiles,
                       tile_m, qk_scale, PART: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                       PIPELINE: gl.constexpr, num_warps: gl.constexpr):
    """Rows [PART·BLOCK_M, (PART+1)·BLOCK_M) of the program's query tile (which starts at tile_m) against
    every key tile the tile sees."""
    q_smem = q_parts.index(PART)
    start_m = tile_m + PART * BLOCK_M
    o_row = row0 + start_m
    if CAUSAL:
        n_full = (start_m + 1) // BLOCK_N  # tiles wholly at or below the diagonal need no mask
    else:
        n_full = n_tiles
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
def ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 1):
    """The mbarriers between a load partition and its consumers, initialised: one for the tiles loaded
    once, and for each of the ring's STAGES slots, the ready barriers of its two tiles and its empty barrier
    (which every consumer arrives on)."""
    once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_a = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(once, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_a.index(i), count=1)
        mbarrier.init(ready_b.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    fence_async_shared()
    return once, ready_a, ready_b, empty


@gluon.jit
def _attn_fwd_ws(q_desc, k_desc, v_desc, O, L, qk_scale, N_CTX, H, GROUP,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, PIPELINE: gl.constexpr, CONSUMERS: gl.constexpr, HEADS_FAST: gl.constexpr,
                 num_warps: gl.constexpr):
    """One program per (query tile, batch·query head), heaviest causal tiles first (HEADS_FAST, causal
    only: across heads too, `grid_order`); q, O as [Z·H·N, d], k, v as [Z·(H/GROUP)·N, d]. q_desc's tiles
    are the consumers' parts: BLOCK_M / CONSUMERS rows."""
    if HEADS_FAST:  # the grid is (batch·heads, query tiles): every head's heaviest tile before any's next
        zh = gl.program_id(0)
        pid_m = gl.num_programs(1) - 1 - gl.program_id(1)
    else:
        pid_m = gl.program_id(0)
        if CAUSAL:
            pid_m = gl.num_programs(0) - 1 - pid_m
        zh = gl.program_id(1)
    start_m = pid_m * BLOCK_M
    row0 = zh * N_CTX
    kv_row0 = ((zh // H) * (H // GROUP) + (zh % H) // GROUP) * N_CTX  # this query head's key/value head
    if CAUSAL:
        n_tiles = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
    else:
        n_tiles = N_CTX // BLOCK_N

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar, k_ready, v_ready, kv_empty = ring_barriers(STAGES, CONSUMERS)

    PART_M: gl.constexpr = BLOCK_M // CONSUMERS
    if CONSUMERS == 2:  # a warp group each (num_warps is one partition's), the load warp's registers theirs
        gl.warp_specialize([
            (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, O, L, row0, n_tiles,
                                  start_m, qk_scale, 0, PART_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PIPELINE,
                                  num_warps)),
            (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, O, L, row0, n_tiles,
                                  start_m, qk_scale, 1, PART_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PIPELINE,
                                  num_warps)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                               row0 + start_m, kv_row0, n_tiles, BLOCK_N, STAGES, CONSUMERS)),
        ], [num_warps, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, O, L, row0, n_tiles,
                                  start_m, qk_scale, 0, PART_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PIPELINE,
                                  num_warps)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                               row0 + start_m, kv_row0, n_tiles, BLOCK_N, STAGES, CONSUMERS)),
        ], [1], [24])


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[coord] += shared `src`, one TMA bulk reduce-add (cp.reduce.async.bulk.tensor). Triton 3.6 has
    the op (GluonOpBuilder.create_async_tma_reduce) without a Gluon name; 3.8 calls it tma.async_atomic_add."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _next_tile(m, head_row, first_m, n_m, N_CTX, row0, row_end):
    """The backward's walk over (query head of the group, query tile): the tile after query tile m of the
    head whose row 0 is head_row, the first again after the last. Carried from tile to tile: t // per_head
    and t % per_head cost two runtime-divisor divisions a tile on the uniform pipe, and 4–7 % of the
    backward kernel's time (H100, docs/benchmarks/attention-h100-uniform-2026-12-07.md)."""
    m += 1
    if m == n_m:
        m = first_m
        head_row += N_CTX
        if head_row == row_end:
            head_row = row0
    return m, head_row


@gluon.jit
def _bwd_load_partition(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready,
                        do_ready, empty, kv_row, q_row0, first_m, n_m, GROUP, N_CTX, BLOCK_M: gl.constexpr,
                        STAGES: gl.constexpr):
    """K and V of the program's key tile once; then Q and dO of each query tile that sees them, for every
    query head of the key/value head's group, through the ring."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [kv_row, 0], kv_bar, v_smem)
    m = first_m
    head_row = q_row0
    for t in range(GROUP * (n_m - first_m)):  # (query head of the group, query tile) in order
        s = t % STAGES
        phase = (t // STAGES) & 1
        row = head_row + m * BLOCK_M
        m, head_row = _next_tile(m, head_row, first_m, n_m, N_CTX, q_row0, q_row0 + GROUP * N_CTX)
        mbarrier.wait(empty.index(s), phase ^ 1)  # barriers start with phase 1 complete: no wait at first
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row, 0], q_ready.index(s), q_smem.index(s))
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [row, 0], do_ready.index(s), do_smem.index(s))


@gluon.jit
def _bwd_compute_partition(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, q_ready, do_ready, empty, L,
                           Delta, DK, DV, dq_desc, lse_row0, start_n, first_m, n_m, GROUP, N_CTX, dk_row, qk_scale,
                           sm_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, EARLY_DP: gl.constexpr,
                           num_warps: gl.constexpr):
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])  # Sᵀ, dPᵀ [BN, BM]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])  # dK, dV [BN, d]
    # dQ [BM, d]: the warp groups take BM / 64 row blocks (an m64 each) and split d between the rest
    WG_M: gl.constexpr = BLOCK_M // 64
    WG_N: gl.constexpr = num_warps // 4 // WG_M
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG_M, WG_N],
                                                        instr_shape=[16, HEAD_DIM // WG_N, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    mbarrier.wait(kv_bar, 0)
    cols_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    lse = gl.load(L + lse_row0 + first_m * BLOCK_M + cols_m)  # the first tile's L and D (each tile loads the next's)
    delta = gl.load(Delta + lse_row0 + first_m * BLOCK_M + cols_m)
    m = first_m
    head_row = lse_row0
    for t in range(GROUP * (n_m - first_m)):
        s = t % STAGES
        phase = (t // STAGES) & 1
        start_m = m * BLOCK_M
        row = head_row + start_m  # of Q, dO, dQ, L and D
        m, head_row = _next_tile(m, head_row, first_m, n_m, N_CTX, lse_row0, lse_row0 + GROUP * N_CTX)

        mbarrier.wait(q_ready.index(s), phase)
        st_tok = warpgroup_mma(k_smem, q_smem.index(s).permute((1, 0)), st_zero, use_acc=False, is_async=True)
        lse2 = lse * 1.4426950408889634  # natural log to log2
        if EARLY_DP:
            mbarrier.wait(do_ready.index(s), phase)
            dpt_tok = warpgroup_mma(v_smem, do_smem.index(s).permute((1, 0)), st_zero, use_acc=False,
                                    is_async=True)
            st = warpgroup_mma_wait(1, deps=[st_tok])  # dPᵀ runs on under the exponentials
        else:
            st = warpgroup_mma_wait(0, deps=[st_tok])
        pt = gl.exp2(st * qk_scale - lse2[None, :])
        if CAUSAL:
            # only the tiles across the diagonal (the first BLOCK_N / BLOCK_M of each head) mask
            if start_m < start_n + BLOCK_N:
                pt = gl.where(start_m + cols_m[None, :] >= offs_n[:, None], pt, 0.0)
        if EARLY_DP:
            dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_smem.index(s), dv, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=[dpt_tok])  # (dV runs on)
        else:
            mbarrier.wait(do_ready.index(s), phase)
            dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_smem.index(s), dv, is_async=True)
            dpt_tok = warpgroup_mma(v_smem, do_smem.index(s).permute((1, 0)), st_zero, use_acc=False,
                                    is_async=True)
            dv_tok, dpt = warpgroup_mma_wait(0, deps=[dv_tok, dpt_tok])
        dst = (pt * (dpt - delta[None, :])).to(dtype)
        dk_tok = warpgroup_mma(gl.convert_layout(dst, a_layout), q_smem.index(s), dk, is_async=True)
        # Two dSᵀ and two dQ buffers: a warp group one tile ahead never overwrites one still being read.
        # Triton's barrier analysis orders every shared-memory write here (stores, the empty arrive) before
        # the next shared access of any buffer with a partition-wide barrier, and adds one after each TMA
        # store wait, so the wait and the writes sit just before the two barriers the data needs: 4 bar.sync
        # per tile (the two extra follow the arrive) instead of 6.
        ds_buf = ds_smem.index(t % 2)
        ds_buf.store(dst)
        fence_async_shared()
        tma.store_wait(1)  # the reduce of tile t-2 has read dq_smem[t % 2] (its issuing thread; the barrier tells all)
        gl.thread_barrier()  # both warp groups' rows of dSᵀ are in place
        dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, dq_zero, use_acc=False, is_async=True)
        # The next tile's L and D (the first's again after the last), loaded under this tile's products and
        # barriers (loaded at the tile's start, their latency stalled the dPᵀ issue).
        row_n = head_row + m * BLOCK_M
        lse = gl.load(L + row_n + cols_m)
        delta = gl.load(Delta + row_n + cols_m)
        dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])
        dq_buf = dq_smem.index(t % 2)
        dq_buf.store(dq)  # (1/√d is applied by the cast that follows the launch)
        fence_async_shared()
        gl.thread_barrier()  # both warp groups' columns of the dQ tile are in place
        mbarrier.arrive(empty.index(s), count=1)  # the slot's Q and dO are read
        _tma_reduce_add(dq_desc, [row, 0], dq_buf)

    tma.store_wait(0)  # the last reduces have read their tiles before the program ends
    dk = dk * sm_scale
    rows = dk_row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    offs = rows.to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(DK + offs, dk.to(dtype))
    gl.store(DV + offs, dv.to(dtype))


@gluon.jit
def _attn_bwd_ws(q_desc, k_desc, v_desc, do_desc, dq_desc, L, Delta, DK, DV, qk_scale, sm_scale, N_CTX, H, GROUP,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, EARLY_DP: gl.constexpr, HEADS_FAST: gl.constexpr, num_warps: gl.constexpr):
    """One program per (key tile, batch·key/value head): dK, dV of its keys, and its share of dQ added to
    the float32 dQ (zeroed) behind dq_desc. q, dO, dQ as [Z·H·N, d], k, v, dK, dV as [Z·(H/GROUP)·N, d],
    L and D as [Z·H·N]. Causal, key tile 0 is the heaviest; HEADS_FAST: the grid is (batch·heads, key
    tiles), every head's first tile before any head's second (`grid_order`)."""
    if HEADS_FAST:
        zhk = gl.program_id(0)
        start_n = gl.program_id(1) * BLOCK_N
    else:
        start_n = gl.program_id(0) * BLOCK_N
        zhk = gl.program_id(1)
    h_kv = H // GROUP
    kv_row = zhk * N_CTX + start_n
    q_row0 = ((zhk // h_kv) * H + (zhk % h_kv) * GROUP) * N_CTX  # the group's first query head, row 0
    n_m = N_CTX // BLOCK_M
    if CAUSAL:
        first_m = start_n // BLOCK_M  # earlier query tiles see none of these keys
    else:
        first_m = 0

    dtype: gl.constexpr = k_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_bar, q_ready, do_ready, empty = ring_barriers(STAGES)

    gl.warp_specialize([
        (_bwd_compute_partition, (k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, q_ready, do_ready,
                                  empty, L, Delta, DK, DV, dq_desc, q_row0, start_n, first_m, n_m, GROUP, N_CTX,
                                  kv_row, qk_scale, sm_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                  EARLY_DP, num_warps)),
        (_bwd_load_partition, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready,
                               do_ready, empty, kv_row, q_row0, first_m, n_m, GROUP, N_CTX, BLOCK_M, STAGES)),
    ], [1], [24])


CAST_BLOCK = 4096  # elements per program of _scale_cast: 8 per thread at a time (16-byte stores of bf16)


@gluon.jit
def _scale_cast(X, Y, scale, n, BLOCK: gl.constexpr, num_warps: gl.constexpr):
    """Y = X·scale in Y's dtype, flat: the backward's float32 dQ to q's dtype, 1/√d applied on the way
    (as fast as a plain .to(bf16); torch.mul with a bf16 `out` was slower)."""
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [num_warps], [0])
    offs = gl.program_id(0).to(gl.int64) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    mask = offs < n
    x = gl.load(X + offs, mask=mask)
    gl.store(Y + offs, (x * scale).to(Y.dtype.element_ty), mask=mask)


def descriptors(q, k, v, block_m: int, block_n: int):
    """TMA descriptors over q, k, v seen as [rows, d] (rows = batch·heads·sequence)."""
    d = q.shape[-1]
    gdt = DTYPES[q.dtype]
    q_desc = TensorDescriptor.from_tensor(q.reshape(-1, d), [block_m, d],
                                          gl.NVMMASharedLayout.get_default_for([block_m, d], gdt))
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    return (q_desc, TensorDescriptor.from_tensor(k.reshape(-1, d), [block_n, d], kv_layout),
            TensorDescriptor.from_tensor(v.reshape(-1, d), [block_n, d], kv_layout))


def supports(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, config: Config | None = None,
             layout: bool = True) -> bool:
    """Whether the kernel computes these [Z, H, N, d] inputs (device aside) with `config` (by default
    CONFIGS' for their head dim): bf16/fp16 alike, d in HEAD_DIMS,
    as many keys as queries and a multiple of the tiles (TMA reads whole tiles, across heads otherwise),
    contiguous and 16-byte aligned (with layout=False: whatever their layout, as contiguous copies would
    be), query heads a multiple of key/value heads, not empty, and at most MAX_GRID_Y batch·heads."""
    d, n = q4.shape[-1], q4.shape[-2]
    config = config or CONFIGS.get(d)
    return (config is not None and d in HEAD_DIMS and q4.dim() == 4 and q4.numel() > 0
            and q4.shape[0] * q4.shape[1] <= MAX_GRID_Y and q4.dtype in DTYPES
            and k4.dtype == q4.dtype and v4.dtype == q4.dtype
            and k4.shape[-2] == n and k4.shape[-1] == d and v4.shape == k4.shape
            and k4.shape[0] == q4.shape[0] and q4.shape[1] % k4.shape[1] == 0
            and n % config.block_m == 0 and n % config.block_n == 0
            and (not layout or all(x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (q4, k4, v4))))


def usable(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, config: Config | None = None,
           layout: bool = True) -> bool:
    """`supports` on an NVIDIA Hopper GPU (the kernel's wgmma and setmaxnreg are sm_90's; a ROCm build
    reports its own capabilities through the same call)."""
    return (q4.is_cuda and torch.version.hip is None and capability(q4.device)[0] == 9
            and supports(q4, k4, v4, config, layout))


# Causal grids run heads-fast (`grid_order`, unless Policy.heads_fast is off): the backward always, the
# forward up to this many programs an SM (one resides at a time). An H200, bf16, kernels alone
# (docs/kernels.md, "Grid order"): at 8 × 1 × 4,096 and 8,192 (256 and 512 programs) the forward −16 to
# −24 %, the backward −17 to −32 %; from 1,024 programs the backward −0 to −4 %, the forward +0 to +5 %
# (the leaderboard's d 128: 1.67 → 1.76 ms, its K and V no longer shared in L2 by the programs running
# together).
FWD_HEADS_FAST_WAVES = 4


def grid_order(tiles: int, heads: int, heads_fast: bool) -> tuple:
    """The grid of `tiles` programs for each of `heads` (batch·heads): (tiles, heads) runs one head's tiles
    after another's; heads_fast, (heads, tiles), the same tile of every head before the next tile. Causal,
    the tiles' work falls from the first to the last, so heads-fast is longest-first across the whole grid:
    at 8 × 1 × 8,192 (512 backward programs, about 4 per SM) a list-scheduling model gives the last SM's
    finish 18 % earlier than head by head (measured: 17 %), at 16 × 16,384 nothing."""
    return (heads, tiles) if heads_fast else (tiles, heads)


def forward(q4, k4, v4, o4, lse, is_causal: bool, config: Config | None = None, heads_fast: bool = True) -> str:
    """Fill o4 [Z, H, N, d] and lse [Z, H, N] (float32) for inputs `usable` accepted; the tiles it ran.
    heads_fast (causal, up to FWD_HEADS_FAST_WAVES programs an SM): `grid_order`'s."""
    Z, H, n, d = q4.shape
    c = config or CONFIGS[d]
    q_desc, k_desc, v_desc = descriptors(q4, k4, v4, c.block_m // c.consumers, c.block_n)
    heads_fast = (bool(is_causal) and heads_fast  # (a few waves: far below MAX_GRID_Y tiles)
                  and (n // c.block_m) * Z * H <= FWD_HEADS_FAST_WAVES * sm_count(q4.device))
    plans.launch(_attn_fwd_ws, grid_order(n // c.block_m, Z * H, heads_fast),
                 (q_desc, k_desc, v_desc, o4, lse, LOG2E / math.sqrt(d), n, H, H // k4.shape[1]),
                 dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_DIM=d, STAGES=c.stages, CAUSAL=bool(is_causal),
                      PIPELINE=c.pipeline, CONSUMERS=c.consumers, HEADS_FAST=heads_fast,
                      num_warps=c.warps // c.consumers, maxnreg=c.maxnreg),
                 ("q", "k", "v", "o", "lse"))
    return f"gluon {c.block_m}×{c.block_n}"


def usable_backward(q4, k4, v4, do4, config: BwdConfig | None = None, layout: bool = True) -> bool:
    """Whether `backward` runs these [Z, H, N, d] inputs: `usable`'s conditions with the backward's tiles
    (by default BWD_CONFIGS' for the head dim: HEAD_DIMS), dO shaped like q, and (unless layout=False) all
    four contiguous and aligned."""
    config = config or BWD_CONFIGS.get(q4.shape[-1])
    return (config is not None and usable(q4, k4, v4, config, layout) and do4.shape == q4.shape
            and do4.dtype == q4.dtype and (not layout or (do4.is_contiguous() and do4.data_ptr() % 16 == 0)))


def backward(q4, k4, v4, do4, lse, delta, dq32, dq4, dk4, dv4, is_causal: bool,
             config: BwdConfig | None = None, prepare: list | None = None, heads_fast: bool = True) -> str:
    """dQ, dK, dV into dq4, dk4, dv4 from L and D = rowsum(dO ∘ O) ([Z, H, N] float32, contiguous), for
    inputs `usable_backward` accepted; the tiles it ran. dq32 (float32, [Z, H, N, d], zeroed) is the
    kernel's: it adds dS·K into it, and one pass casts that, times 1/√d, into dq4 (the scale is free there
    and costs a multiply per element per key tile in the kernel). prepare: a list that the two kernels'
    compiles (their `warmup` with these arguments) are appended to instead of running them. heads_fast
    (causal): `grid_order`'s."""
    Z, H, n, d = q4.shape
    c = config or BWD_CONFIGS[d]
    assert dq32.is_contiguous() and dq4.is_contiguous() and dq4.shape == dq32.shape  # _scale_cast is flat
    q_desc, k_desc, v_desc = descriptors(q4, k4, v4, c.block_m, c.block_n)
    do_desc = TensorDescriptor.from_tensor(do4.reshape(-1, d), [c.block_m, d], q_desc.layout)
    dq_desc = TensorDescriptor.from_tensor(dq32.view(-1, d), [c.block_m, d],
                                           gl.NVMMASharedLayout.get_default_for([c.block_m, d], gl.float32))
    elems = dq32.numel()
    heads_fast = bool(is_causal) and heads_fast and n // c.block_n <= MAX_GRID_Y  # the tiles on the 2nd dim
    launches = [
        (_attn_bwd_ws, grid_order(n // c.block_n, Z * k4.shape[1], heads_fast),
         (q_desc, k_desc, v_desc, do_desc, dq_desc, lse, delta, dk4, dv4, LOG2E / math.sqrt(d), 1.0 / math.sqrt(d),
          n, H, H // k4.shape[1]),
         dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_DIM=d, STAGES=c.stages, CAUSAL=bool(is_causal),
              EARLY_DP=c.early_dp, HEADS_FAST=heads_fast, num_warps=c.warps, maxnreg=c.maxnreg),
         ("q", "k", "v", "do", "dq32", "lse", "delta", "dk", "dv")),
        (_scale_cast, (triton.cdiv(elems, CAST_BLOCK),), (dq32, dq4, 1.0 / math.sqrt(d), elems),
         dict(BLOCK=CAST_BLOCK, num_warps=4), ("dq32", "dq")),
    ]
    for kernel, grid, args, consts, names in launches:
        if prepare is None:
            plans.launch(kernel, grid, args, consts, names)
        else:
            prepare.append(functools.partial(kernel.warmup, *args, grid=grid, **consts))
    return f"gluon {c.block_m}×{c.block_n}"

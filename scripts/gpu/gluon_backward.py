"""flash-triton's backward in Gluon for Hopper (issue 12): checks against float64 and times, at the
leaderboard shape, the one-launch backward that flash-triton runs at d 128 (lmsys.kernels.flash_gluon:
`_attn_bwd_ws`, dQ by TMA bulk reduce-adds) at several tiles, and two deterministic kernels measured
slower than the tl ones (docs/benchmarks/attention.md, sixth session), kept as the base of that lever:

- `_attn_bwd_dkdv_ws`, one program per key tile: the one-launch kernel's load partition (K and V once, Q
  and dO of each query tile through the ring) and a compute partition (8 warps: two warp groups, 64 keys
  each) that runs Sᵀ = K Qᵀ, Pᵀ = exp2(Sᵀ·scale·log2 e − L·log2 e) (masked on the causal diagonal),
  dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − D), dK += dSᵀ Q as wgmma with Pᵀ and dSᵀ in registers as the
  A operands (dV and dPᵀ issued together);
- `_attn_bwd_dq_ws`, one program per query tile, the same the other way round (Q and dO once, K and V
  through the ring; S and dP issued together, dQ += dS K).

All read L (the forward's natural-log logsumexp) and D = rowsum(dO ∘ O), for bf16/fp16, d 64 or 128,
n_q = n_k a multiple of the tiles, contiguous, grouped-query allowed.

    PYTHONPATH=src python scripts/gpu/gluon_backward.py --compile-only   # CPU, triton 3.6: compile + ptxas
    PYTHONPATH=src python scripts/gpu/gluon_backward.py [--fused-only]   # an H100/H200: check, then time
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lmsys.kernels import flash_gluon
from lmsys.kernels.flash_gluon import LOG2E, descriptors, ring_barriers
from lmsys.kernels.flash_gluon import _bwd_load_partition as _load_partition

@gluon.jit
def _compute_partition(k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty, L, Delta, DK, DV,
                       lse_row0, start_n, first_m, n_m, GROUP, N_CTX, dk_row, qk_scale, sm_scale,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_M, 16])  # Sᵀ, dPᵀ [BN, BM]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])  # dK, dV [BN, d]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=st_layout)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    mbarrier.wait(kv_bar, 0)
    per_head = n_m - first_m
    for t in range(GROUP * per_head):
        s = t % STAGES
        phase = (t // STAGES) & 1
        start_m = (first_m + t % per_head) * BLOCK_M
        row = lse_row0 + (t // per_head) * N_CTX + start_m
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        lse2 = gl.load(L + row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))) * 1.4426950408889634
        delta = gl.load(Delta + row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout)))

        mbarrier.wait(q_ready.index(s), phase)
        st_tok = warpgroup_mma(k_smem, q_smem.index(s).permute((1, 0)), st_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(0, deps=[st_tok])
        pt = gl.exp2(st * qk_scale - lse2[None, :])
        if CAUSAL:
            pt = gl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)  # (a no-op below the diagonal tiles)
        mbarrier.wait(do_ready.index(s), phase)
        dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do_smem.index(s), dv, is_async=True)
        dpt_tok = warpgroup_mma(v_smem, do_smem.index(s).permute((1, 0)), st_zero, use_acc=False, is_async=True)
        dv, dpt = warpgroup_mma_wait(0, deps=[dv_tok, dpt_tok])
        dst = pt * (dpt - delta[None, :])
        dk_tok = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), q_smem.index(s), dk, is_async=True)
        dk = warpgroup_mma_wait(0, deps=[dk_tok])
        mbarrier.arrive(empty.index(s), count=1)

    dk = dk * sm_scale
    rows = dk_row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    offs = rows.to(gl.int64)[:, None] * HEAD_DIM + cols[None, :]
    gl.store(DK + offs, dk.to(dtype))
    gl.store(DV + offs, dv.to(dtype))


@gluon.jit
def _attn_bwd_dkdv_ws(q_desc, k_desc, v_desc, do_desc, L, Delta, DK, DV, qk_scale, sm_scale, N_CTX, H, GROUP,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """One program per (key tile, batch·key/value head); q, dO as [Z·H·N, d], k, v, dK, dV as
    [Z·(H/GROUP)·N, d], L and D as [Z·H·N]. Causal key tiles with the most query tiles start first (pid 0)."""
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
    kv_bar, q_ready, do_ready, empty = ring_barriers(STAGES)

    gl.warp_specialize([
        (_compute_partition, (k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty, L, Delta, DK, DV,
                              q_row0, start_n, first_m, n_m, GROUP, N_CTX, kv_row, qk_scale, sm_scale, BLOCK_M,
                              BLOCK_N, HEAD_DIM, STAGES, CAUSAL, num_warps)),
        (_load_partition, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready,
                           do_ready, empty, kv_row, q_row0, first_m, n_m, GROUP, N_CTX, BLOCK_M, STAGES)),
    ], [1], [24])


@gluon.jit
def _dq_load_partition(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, v_ready,
                       empty, q_row, kv_row, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(qdo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], qdo_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [q_row, 0], qdo_bar, do_smem)
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _dq_compute_partition(q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, v_ready, empty, L, Delta, DQ, q_row,
                          start_m, n_full, n_tiles, qk_scale, sm_scale, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                          CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # S, dP [BM, BN]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])  # dQ [BM, d]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    lse2 = gl.load(L + q_row + rows) * 1.4426950408889634
    delta = gl.load(Delta + q_row + rows)
    offs_m = start_m + rows
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(qdo_bar, 0)
    for j in range(n_tiles):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        s_tok = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(s), phase)
        dp_tok = warpgroup_mma(do_smem, v_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc, dp = warpgroup_mma_wait(0, deps=[s_tok, dp_tok])
        p = gl.exp2(sc * qk_scale - lse2[:, None])
        if CAUSAL and j >= n_full:
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        ds = p * (dp - delta[:, None])
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), k_smem.index(s), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(empty.index(s), count=1)

    dq = dq * sm_scale
    out_rows = q_row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    gl.store(DQ + out_rows.to(gl.int64)[:, None] * HEAD_DIM + cols[None, :], dq.to(dtype))


@gluon.jit
def _attn_bwd_dq_ws(q_desc, k_desc, v_desc, do_desc, L, Delta, DQ, qk_scale, sm_scale, N_CTX, H, GROUP,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """One program per (query tile, batch·query head), the causal tiles that see the most keys first."""
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    zh = gl.program_id(1)
    start_m = pid_m * BLOCK_M
    q_row = zh * N_CTX + start_m
    kv_row = ((zh // H) * (H // GROUP) + (zh % H) // GROUP) * N_CTX
    if CAUSAL:
        n_tiles = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
        n_full = (start_m + 1) // BLOCK_N
    else:
        n_tiles = N_CTX // BLOCK_N
        n_full = n_tiles

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    qdo_bar, k_ready, v_ready, empty = ring_barriers(STAGES)

    gl.warp_specialize([
        (_dq_compute_partition, (q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready, v_ready, empty, L, Delta, DQ,
                                 q_row, start_m, n_full, n_tiles, qk_scale, sm_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                                 STAGES, CAUSAL, num_warps)),
        (_dq_load_partition, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_smem, v_smem, qdo_bar, k_ready,
                              v_ready, empty, q_row, kv_row, n_tiles, BLOCK_N, STAGES)),
    ], [1], [24])


def _descriptors(q, k, v, do, block_m, block_n):
    """The forward's descriptors over q, k, v, and dO's, tiled as q."""
    q_desc, k_desc, v_desc = descriptors(q, k, v, block_m, block_n)
    d = q.shape[-1]
    return q_desc, k_desc, v_desc, TensorDescriptor.from_tensor(do.reshape(-1, d), [block_m, d], q_desc.layout)


def gluon_dkdv(q, k, v, do, lse, delta, causal, *, block_m=64, block_n=128, stages=2, num_warps=8, maxnreg=168):
    """(dK, dV) for [Z, H, N, d] q, dO and [Z, Hkv, N, d] k, v, from L and D [Z, H, N] float32."""
    Z, H, N, d = q.shape
    assert d in (64, 128) and N % block_m == 0 and N % block_n == 0 and block_n == 16 * num_warps
    assert all(x.is_contiguous() for x in (q, k, v, do, lse, delta)) and H % k.shape[1] == 0
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    descs = _descriptors(q, k, v, do, block_m, block_n)
    grid = (N // block_n, Z * k.shape[1])
    _attn_bwd_dkdv_ws[grid](*descs, lse, delta, dk, dv, LOG2E / math.sqrt(d), 1.0 / math.sqrt(d), N, H,
                            H // k.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages,
                            CAUSAL=causal, num_warps=num_warps, maxnreg=maxnreg)
    return dk, dv


def gluon_dq(q, k, v, do, lse, delta, causal, *, block_m=128, block_n=64, stages=2, num_warps=8, maxnreg=168):
    """dQ for [Z, H, N, d] q, dO and [Z, Hkv, N, d] k, v, from L and D [Z, H, N] float32."""
    Z, H, N, d = q.shape
    assert d in (64, 128) and N % block_m == 0 and N % block_n == 0 and block_m == 16 * num_warps
    assert all(x.is_contiguous() for x in (q, k, v, do, lse, delta)) and H % k.shape[1] == 0
    dq = torch.empty_like(q)
    descs = _descriptors(q, k, v, do, block_m, block_n)
    _attn_bwd_dq_ws[(N // block_m, Z * H)](*descs, lse, delta, dq, LOG2E / math.sqrt(d), 1.0 / math.sqrt(d), N, H,
                                          H // k.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d,
                                          STAGES=stages, CAUSAL=causal, num_warps=num_warps, maxnreg=maxnreg)
    return dq


def gluon_fused(q, k, v, do, lse, delta, causal, *, block_m=64, block_n=128, stages=2, num_warps=8, maxnreg=168):
    """(dQ, dK, dV) from flash_gluon's one-launch backward (dQ by TMA reduce-adds into float32)."""
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    flash_gluon.backward(q, k, v, do, lse, delta, dq, dk, dv, causal,
                         flash_gluon.BwdConfig(block_m, block_n, stages, num_warps, maxnreg))
    return dq.to(q.dtype), dk, dv


# (BLOCK_M, BLOCK_N, STAGES, warps, maxnreg); dK/dV: BLOCK_N = 16·warps (keys per warp group's rows)
SWEEP = [(64, 128, 2, 8, 168), (64, 128, 3, 8, 168), (32, 128, 3, 8, 168), (64, 64, 2, 4, 128)]
# dQ: BLOCK_M = 16·warps (queries)
DQ_SWEEP = [(128, 64, 2, 8, 168), (128, 64, 3, 8, 168), (128, 128, 2, 8, 168), (64, 64, 3, 4, 128)]
# one launch (flash_gluon.BwdConfig): BLOCK_M = 64 (dQ's rows: one warp group's m64), BLOCK_N = 16·warps
FUSED_SWEEP = [(64, 128, 2, 8, 168), (64, 128, 1, 8, 168), (64, 64, 2, 4, 168)]


KERNEL_NAMES = {_attn_bwd_dkdv_ws: "dkdv", _attn_bwd_dq_ws: "dq", flash_gluon._attn_bwd_ws: "fused"}


def compile_only(args) -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compile_sm90 import compile_gluon, report

    ok = True
    for d in (64, 128):
        for causal in (True, False):
            for fn, (bm, bn, stages, warps, regs) in ([(_attn_bwd_dkdv_ws, c) for c in SWEEP]
                                                      + [(_attn_bwd_dq_ws, c) for c in DQ_SWEEP]
                                                      + [(flash_gluon._attn_bwd_ws, c) for c in FUSED_SWEEP]):
                if args.kernels and KERNEL_NAMES[fn] not in args.kernels.split(","):
                    continue
                x, f32 = torch.empty(256, d, dtype=torch.bfloat16), torch.empty(4)
                dq_desc = TensorDescriptor.from_tensor(torch.empty(256, d), [bm, d],
                                                       gl.NVMMASharedLayout.get_default_for([bm, d], gl.float32))
                descs = _descriptors(x, x, x, x, bm, bn)
                example = {_attn_bwd_dkdv_ws: [*descs, f32, f32, x, x], _attn_bwd_dq_ws: [*descs, f32, f32, x],
                           flash_gluon._attn_bwd_ws: [*descs, dq_desc, f32, f32, x, x]}[fn] + [0.5, 0.5, 256, 1, 1]
                consts = dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, STAGES=stages, CAUSAL=causal, num_warps=warps)
                name = (f"{KERNEL_NAMES[fn]}: d {d}, causal {causal}, {bm}×{bn}, "
                        f"{stages} stages, {warps} warps, maxnreg {regs}")
                ok &= report(name, lambda: compile_gluon(fn, example, consts, num_warps=warps, maxnreg=regs))
    return 0 if ok else 1


def check_and_time(args) -> int:
    from triton.testing import do_bench

    from lmsys.kernels import flash_triton

    torch.manual_seed(0)
    dev = "cuda"
    for (Z, H, Hkv, N, d, causal) in [(2, 2, 2, 256, 64, True), (1, 4, 2, 512, 128, True), (2, 2, 1, 384, 64, False),
                                      (1, 2, 2, 1024, 128, True)]:
        q = torch.randn(Z, H, N, d, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(Z, Hkv, N, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        o, lse = flash_triton.flash_forward(q, k, v, causal)
        delta = (o.float() * do.float()).sum(-1).contiguous()
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        kr, vr = (x.repeat_interleave(H // Hkv, dim=1) for x in (k64, v64))
        s = q64 @ kr.transpose(-1, -2) / math.sqrt(d)
        if causal:
            s = s.masked_fill(torch.ones(N, N, device=dev, dtype=torch.bool).triu(1), float("-inf"))
        ref_dq, ref_dk, ref_dv = torch.autograd.grad(torch.softmax(s, -1) @ vr, (q64, k64, v64), do.double())
        for bm, bn, stages, warps, regs in [] if args.fused_only else DQ_SWEEP:
            dq = gluon_dq(q, k, v, do, lse, delta, causal, block_m=bm, block_n=bn, stages=stages, num_warps=warps,
                          maxnreg=regs)
            err = ((dq.double() - ref_dq).norm() / ref_dq.norm()).item()
            print(f"check Z{Z} H{H}/{Hkv} N{N} d{d} causal {causal} dQ {bm}×{bn} {stages} st {warps} warps: "
                  f"rel err {err:.2e} {'ok' if err < 2e-2 else 'FAIL'}", flush=True)
            if err >= 2e-2:
                return 1
        for bm, bn, stages, warps, regs in FUSED_SWEEP:
            grads = gluon_fused(q, k, v, do, lse, delta, causal, block_m=bm, block_n=bn, stages=stages,
                                num_warps=warps, maxnreg=regs)
            errs = [((x.double() - r).norm() / r.norm()).item() for x, r in zip(grads, (ref_dq, ref_dk, ref_dv))]
            ok = max(errs) < 2e-2
            print(f"check Z{Z} H{H}/{Hkv} N{N} d{d} causal {causal} fused {bm}×{bn} {stages} st {warps} warps "
                  f"{regs} regs: dQ rel err {errs[0]:.2e}, dK {errs[1]:.2e}, dV {errs[2]:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                return 1
        if args.fused_only:
            continue
        for bm, bn, stages, warps, regs in SWEEP:
            dk, dv = gluon_dkdv(q, k, v, do, lse, delta, causal, block_m=bm, block_n=bn, stages=stages,
                                num_warps=warps, maxnreg=regs)
            torch.cuda.synchronize()
            errs = [((x.double() - r).norm() / r.norm()).item() for x, r in ((dk, ref_dk), (dv, ref_dv))]
            ok = max(errs) < 2e-2
            print(f"check Z{Z} H{H}/{Hkv} N{N} d{d} causal {causal} {bm}×{bn} {stages} st {warps} warps: "
                  f"dK rel err {errs[0]:.2e}, dV {errs[1]:.2e} {'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                return 1
    print("| d | impl | ms | TFLOP/s |\n|---|---|---|---|")
    for d in (64, 128):
        q, k, v, do = (torch.randn(1, 16, 16384, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
        o, lse = flash_triton.flash_forward(q, k, v, True)
        delta = (o.float() * do.float()).sum(-1).contiguous()
        bwd_flops = 2.5 * 4 * 16 * 16384 * 16384 * d / 2
        dkdv_flops = bwd_flops * 4 / 5  # TFLOP/s of a kernel alone: its products (dK/dV four, dQ three) of five
        rows = {"flash-triton backward (dQ + dK/dV kernels)":
                (lambda: flash_triton.flash_backward(q, k, v, o, lse, do, True), bwd_flops)}
        for bm, bn, stages, warps, regs in FUSED_SWEEP:  # D = rowsum(dO ∘ O) included
            rows[f"gluon one launch (TMA reduce-add dQ), {bm}×{bn}, {stages} st, {warps} warps"] = (
                lambda bm=bm, bn=bn, stages=stages, warps=warps, regs=regs: gluon_fused(
                    q, k, v, do, lse, (o.float() * do.float()).sum(-1), True, block_m=bm, block_n=bn,
                    stages=stages, num_warps=warps, maxnreg=regs), bwd_flops)
        for bm, bn, stages, warps, regs in [] if args.fused_only else DQ_SWEEP:
            rows[f"gluon dQ alone, {bm}×{bn}, {stages} st, {warps} warps"] = (
                lambda bm=bm, bn=bn, stages=stages, warps=warps, regs=regs: gluon_dq(
                    q, k, v, do, lse, delta, True, block_m=bm, block_n=bn, stages=stages, num_warps=warps,
                    maxnreg=regs), bwd_flops * 3 / 5)
        for bm, bn, stages, warps, regs in [] if args.fused_only else SWEEP:
            rows[f"gluon dK/dV alone, {bm}×{bn}, {stages} st, {warps} warps"] = (
                lambda bm=bm, bn=bn, stages=stages, warps=warps, regs=regs: gluon_dkdv(
                    q, k, v, do, lse, delta, True, block_m=bm, block_n=bn, stages=stages, num_warps=warps,
                    maxnreg=regs), dkdv_flops)
        for name, (f, flops) in rows.items():
            try:
                ms = do_bench(f, warmup=25, rep=200)
                print(f"| {d} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |", flush=True)
            except Exception as e:  # noqa: BLE001 - a row that fails says why
                print(f"| {d} | {name} | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--kernels", default="", help="dkdv,dq,fused (default: all)")
    p.add_argument("--fused-only", action="store_true", help="check and time the one-launch kernel alone")
    args = p.parse_args(argv)
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_only(args)
    return check_and_time(args)


if __name__ == "__main__":
    sys.exit(main())

"""A Gluon forward for Hopper: the lever tl cannot reach (issue 12). A probe, not yet a product path.

triton.language leaves the warp roles to the compiler; Gluon (triton.experimental.gluon, in the same
triton 3.6 wheel) lets the kernel say them, with register budgets per role (setmaxnreg underneath):

- a load partition, one warp with 24 registers, brings Q once and K, V tiles through a ring of STAGES
  shared buffers by TMA, with ready/empty mbarriers (K and V on separate ready barriers, so QKᵀ starts
  before V has landed);
- the default partition, 8 warps (two warp groups, 64 query rows each), runs the two products as async
  wgmma and the online softmax in registers; with PIPELINE it issues the next tile's QKᵀ before this
  tile's softmax, so the tensor cores work under the exponentials (FlashAttention-3's intra-warpgroup
  overlap).

Scope of the probe: bf16/fp16, d 64 or 128, sequence lengths that are multiples of the tile (128),
q, k, v [B, H, N, d] contiguous, causal or not. It returns O and L like flash_forward.

    python scripts/gpu/gluon_attention.py --compile-only  # CPU: compile for sm_90 (no GPU needed)
    python scripts/gpu/gluon_attention.py                 # GPU: check against float64, then time
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
PIPELINES = {0: "", 1: ", next QKᵀ under softmax", 2: ", FA3 order (QKᵀ and PV under softmax)"}
# (BLOCK_M, BLOCK_N, STAGES, PIPELINE, compute warps, maxnreg) timed at the leaderboard shape
SWEEP = [(128, 128, 3, 0, 8, 168), (128, 128, 3, 1, 8, 168), (128, 128, 3, 2, 8, 168),
         # one warp group per CTA, two CTAs per SM where shared memory allows: the hardware interleaves them
         (64, 128, 2, 1, 4, 128), (64, 128, 2, 2, 4, 128), (64, 128, 3, 2, 4, 128), (64, 64, 3, 1, 4, 128),
         (64, 64, 3, 2, 4, 128), (64, 64, 4, 2, 4, 128)]


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
def _attn_fwd_ws(q_desc, k_desc, v_desc, O, L, qk_scale, N_CTX,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, PIPELINE: gl.constexpr, num_warps: gl.constexpr):
    """One program per (query tile, batch·head), heaviest causal tiles first; q, k, v, O as [B·H·N, d]."""
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    zh = gl.program_id(1)
    start_m = pid_m * BLOCK_M
    row0 = zh * N_CTX
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
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, O, L, row0 + start_m,
                              n_full, n_tiles, start_m, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                              PIPELINE, num_warps)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                           row0 + start_m, row0, n_tiles, BLOCK_N, STAGES)),
    ], [1], [24])


def _descriptors(q, k, v, block_m, block_n):
    d = q.shape[-1]
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    q2, k2, v2 = (x.reshape(-1, d) for x in (q, k, v))
    q_desc = TensorDescriptor.from_tensor(q2, [block_m, d], gl.NVMMASharedLayout.get_default_for([block_m, d], gdt))
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    return q_desc, TensorDescriptor.from_tensor(k2, [block_n, d], kv_layout), TensorDescriptor.from_tensor(
        v2, [block_n, d], kv_layout)


def gluon_forward(q, k, v, causal=True, *, block_m=128, block_n=128, stages=3, pipeline=2, num_warps=8,
                  maxnreg=168):
    """(O, L) as flash_forward returns them, for the probe's scope (module docstring)."""
    B, H, N, d = q.shape
    assert k.shape == q.shape and v.shape == q.shape and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert d in (64, 128) and N % block_m == 0 and N % block_n == 0 and (block_m % block_n == 0 or block_n % block_m == 0)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    q_desc, k_desc, v_desc = _descriptors(q, k, v, block_m, block_n)
    grid = (N // block_m, B * H)
    _attn_fwd_ws[grid](q_desc, k_desc, v_desc, o, lse, LOG2E / math.sqrt(d), N, BLOCK_M=block_m, BLOCK_N=block_n,
                       HEAD_DIM=d, STAGES=stages, CAUSAL=causal, PIPELINE=pipeline, num_warps=num_warps,
                       maxnreg=maxnreg)
    return o, lse


def compile_only(args) -> int:
    """Compile the kernel for sm_90 on a machine without a GPU (Gluon needs no device to compile)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    failed = 0
    for d in (64, 128):
        for bm, bn, stages, pipeline, warps, regs in SWEEP:
            if 2 * d * (bm + 2 * stages * bn) > 227 * 1024:
                continue
            x = torch.empty(256, d, dtype=torch.bfloat16)
            descs = _descriptors(x, x, x, bm, bn)
            fn = _attn_fwd_ws
            consts = dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, STAGES=stages, CAUSAL=True, PIPELINE=pipeline,
                          num_warps=warps)
            values = dict(zip(fn.arg_names, [*descs, x, torch.empty(1), 0.5, 256]))
            sig = {n: "constexpr" if n in consts else mangle_type(values[n]) for n in fn.arg_names}
            src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
            name = f"d {d}, {bm}×{bn}, {stages} stages, {warps} warps, maxnreg {regs}{PIPELINES[pipeline]}"
            try:
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": warps, "maxnreg": regs})
                print(f"{name}: compiled, shared {k.metadata.shared / 1024:.0f} KiB; ptxas: {_ptxas_notes(k)}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - print what failed and go on
                failed += 1
                print(f"{name}: FAILED {type(e).__name__}: {e}"[:3000], flush=True)
    return 1 if failed else 0


def _ptxas_notes(kernel) -> str:
    """What ptxas says of the kernel's PTX that matters here: spills, and wgmma serialised (C7514) or
    waits it had to inject (C7517)."""
    import re
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        err = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
    notes = re.findall(r"\d+ bytes spill stores", err)
    notes += ["wgmma serialised (C7514)"] * ("C7514" in err) + ["wait injected (C7517)"] * ("C7517" in err)
    return ", ".join(notes)


def check_and_time(args) -> int:
    from triton.testing import do_bench

    from lmsys.kernels.flash_triton import flash_forward

    torch.manual_seed(0)
    dev = "cuda"
    worst = 0.0
    for (B, H, N, d, causal) in [(2, 3, 384, 64, True), (1, 2, 512, 128, True), (2, 2, 256, 128, False),
                                 (1, 4, 640, 64, False)]:
        q, k, v = (torch.randn(B, H, N, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        for pipeline, bm, bn, warps in ((2, 128, 128, 8), (1, 128, 128, 8), (0, 128, 128, 8), (2, 128, 64, 8),
                                        (1, 64, 128, 4), (2, 64, 64, 4)):
            o, lse = gluon_forward(q, k, v, causal, pipeline=pipeline, block_m=bm, block_n=bn, stages=2,
                                   num_warps=warps, maxnreg=168 if warps == 8 else 128)
            torch.cuda.synchronize()
            s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
            if causal:
                s = s.masked_fill(torch.ones(N, N, device=dev, dtype=torch.bool).triu(1), float("-inf"))
            ref_l = torch.logsumexp(s, -1)
            ref_o = torch.softmax(s, -1) @ v.double()
            err_o = ((o.double() - ref_o).norm() / ref_o.norm()).item()
            err_l = (lse.double() - ref_l).abs().max().item()
            worst = max(worst, err_o)
            ok = err_o < 1e-2 and err_l < 1e-2
            print(f"check B{B} H{H} N{N} d{d} causal {causal} {bm}×{bn} {warps} warps pipeline {pipeline}: O rel err {err_o:.2e}, "
                  f"L max abs err {err_l:.2e} {'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                return 1
    print("| d | impl | fwd ms | TFLOP/s |\n|---|---|---|---|")
    for d in (64, 128):
        B, H, N = 1, 16, 16384
        q, k, v = (torch.randn(B, H, N, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * N * N * d / 2
        impls = {"sdpa-cudnn": lambda: _cudnn(q, k, v), "flash-triton": lambda: flash_forward(q, k, v, True)}
        for bm, bn, stages, pipeline, warps, regs in SWEEP:
            smem = 2 * d * (bm + 2 * stages * bn)
            if smem > 227 * 1024:
                continue
            name = f"gluon {bm}×{bn}, {stages} st, {warps} warps{PIPELINES[pipeline]}"
            impls[name] = (lambda bm=bm, bn=bn, stages=stages, pipeline=pipeline, warps=warps, regs=regs:
                           gluon_forward(q, k, v, True, block_m=bm, block_n=bn, stages=stages, pipeline=pipeline,
                                         num_warps=warps, maxnreg=regs))
        for name, f in impls.items():
            try:
                ms = do_bench(f, warmup=25, rep=200)
                print(f"| {d} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |", flush=True)
            except Exception as e:  # noqa: BLE001 - a row that fails says why
                print(f"| {d} | {name} | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)
    return 0


def _cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--maxnreg", type=int, default=168)
    args = p.parse_args(argv)
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_only(args)
    return check_and_time(args)


if __name__ == "__main__":
    sys.exit(main())

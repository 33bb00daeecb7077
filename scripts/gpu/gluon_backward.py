"""flash-triton's one-launch backward in Gluon (lmsys.kernels.flash_gluon.backward: dK/dV per key tile, dQ
by TMA bulk reduce-adds) at several tiles: checks against float64, then times each beside the tl backward
at the leaderboard shape (bf16, causal, batch 1, 16 heads, seq 16384; D = rowsum(dO ∘ O), the zeroed float32
dQ and its cast included, as flash_backward does). The kernel's history (the deterministic Gluon dK/dV
and dQ kernels, dQ by element-wise atomics or red.v2, the next Sᵀ issued early, 128-row tiles, a
partition per warp group with dQ adds of its own: all measured slower) is in docs/benchmarks/attention.md,
sixth and seventh sessions; the code of the sixth session's variants is in git (commit fee482a).
--fwd-bwd times forward+backward through autograd instead (the bench's path), each config in turn as the
shipped one, beside cuDNN and the tl kernels: the measurement that decides (seventh session).

    PYTHONPATH=src python scripts/gpu/gluon_backward.py --compile-only   # CPU, triton 3.6: compile + ptxas
    PYTHONPATH=src python scripts/gpu/gluon_backward.py                  # an H100/H200: check, then time

With --against FILE (a flash_gluon.py of an earlier commit: `git show REV:src/lmsys/kernels/flash_gluon.py >
FILE`) that version's shipped backward is checked and timed in the same run, beside today's configs.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
from dataclasses import replace

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lmsys.kernels import flash_gluon
from lmsys.kernels.flash_gluon import BwdConfig

# per head dim: BLOCK_M (dQ's rows: an m64 per warp group), BLOCK_N = 16·warps, stages, warps, maxnreg
# early_dp (dPᵀ issued beside Sᵀ)
CONFIGS = {64: [BwdConfig(64, 128, 2, 8, 168, True)],
           128: [BwdConfig(64, 128, 2, 8, 168, True)]}


def one_launch(q, k, v, do, lse, delta, causal, config: BwdConfig | None, module=flash_gluon):
    """(dQ, dK, dV) for [Z, H, N, d] q, dO and [Z, Hkv, N, d] k, v, from L and D [Z, H, N] float32."""
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if "dq4" not in inspect.signature(module.backward).parameters:  # an --against file before the scaled cast
        module.backward(q, k, v, do, lse, delta, dq32, dk, dv, causal, config)
        return dq32.to(q.dtype), dk, dv
    dq = torch.empty_like(q)
    module.backward(q, k, v, do, lse, delta, dq32, dq, dk, dv, causal, config)
    return dq, dk, dv


def name(c: BwdConfig) -> str:
    return (f"{c.block_m}×{c.block_n}, {c.stages} st, {c.warps} warps, maxnreg {c.maxnreg}"
            f"{', dPᵀ beside Sᵀ' if c.early_dp else ''}")


def compile_only() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compile_sm90 import compile_gluon, report

    ok = True
    for d in (64, 128):
        for causal in (True, False):
            for c in CONFIGS[d]:
                x, f32 = torch.empty(256, d, dtype=torch.bfloat16), torch.empty(4)
                q_desc, k_desc, v_desc = flash_gluon.descriptors(x, x, x, c.block_m, c.block_n)
                dq_desc = TensorDescriptor.from_tensor(torch.empty(256, d), [c.block_m, d],
                                                       gl.NVMMASharedLayout.get_default_for([c.block_m, d], gl.float32))
                example = [q_desc, k_desc, v_desc, q_desc, dq_desc, f32, f32, x, x, 0.5, 0.5, 256, 1, 1]
                consts = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_DIM=d, STAGES=c.stages, CAUSAL=causal,
                              EARLY_DP=c.early_dp, num_warps=c.warps)
                ok &= report(f"d {d}, causal {causal}, {name(c)}",
                             lambda: compile_gluon(flash_gluon._attn_bwd_ws, example, consts, num_warps=c.warps,
                                                   maxnreg=c.maxnreg))
    return 0 if ok else 1


def runs_at(d: int, c: BwdConfig | None, module) -> bool:
    """Whether a variant runs at head dim d: one of CONFIGS[d], or an --against module's shipped config."""
    return c in CONFIGS[d] if c is not None else d in module.BWD_CONFIGS


def check_and_time(against: str | None = None, repeats: int = 1, dims=(64, 128)) -> int:
    from gluon_attention import load_against, time_rows  # this script's folder is on sys.path when it runs

    from lmsys.kernels import flash_triton
    from lmsys.bench.flash_check import reference_attention

    variants = {name(c): (c, flash_gluon) for c in CONFIGS[64] + CONFIGS[128]}
    if against:
        variants[f"{os.path.basename(against)}, its own tiles"] = (None, load_against(against))

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
        o_ref, _ = reference_attention(q64, k64, v64, causal, device=dev)
        refs = torch.autograd.grad(o_ref, (q64, k64, v64), do.double())
        for label, (c, module) in variants.items():
            if not runs_at(d, c, module):
                continue
            grads = one_launch(q, k, v, do, lse, delta, causal, c, module)
            errs = [((x.double() - r).norm() / r.norm()).item() for x, r in zip(grads, refs)]
            ok = max(errs) < 2e-2
            print(f"check Z{Z} H{H}/{Hkv} N{N} d{d} causal {causal} {label}: dQ rel err {errs[0]:.2e}, "
                  f"dK {errs[1]:.2e}, dV {errs[2]:.2e} {'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                return 1
    print("| d | impl | ms | TFLOP/s |\n|---|---|---|---|")
    for d in dims:
        q, k, v, do = (torch.randn(1, 16, 16384, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
        o, lse = flash_triton.flash_forward(q, k, v, True)
        flops = 2.5 * 4 * 16 * 16384 * 16384 * d / 2
        tl = replace(flash_triton.default_policy(), deterministic=True)
        rows = {"flash-triton tl backward (dQ + dK/dV kernels)":
                lambda: flash_triton.flash_backward(q, k, v, o, lse, do, True, policy=tl)}
        for label, (c, module) in variants.items():
            if not runs_at(d, c, module):
                continue
            rows[f"gluon one launch, {label}"] = lambda c=c, m=module: one_launch(
                q, k, v, do, lse, (o.float() * do.float()).sum(-1), True, c, m)
        for _ in range(repeats):  # interleaved: a host's drift shows as spread, not as a difference
            time_rows(d, rows, flops)
    return 0


def through_autograd(repeats: int, dims) -> int:
    """flash-triton's forward+backward through autograd (the bench's path: D, dQ's zeroing and cast, the
    model's dispatch) with BWD_CONFIGS[d] set to each config of the head dim in turn (and removed: the tl
    kernels), beside sdpa-cudnn, at the leaderboard shape, interleaved `repeats` times."""
    from triton.testing import do_bench

    from gluon_attention import _cudnn
    from lmsys.kernels import flash_triton

    print("| d | round | impl | fwd+bwd ms | TFLOP/s |\n|---|---|---|---|---|")
    for d in dims:
        q, k, v = (torch.randn(1, 16, 16384, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        flops = 4 * 16 * 16384 * 16384 * d / 2 * 3.5  # forward + 2.5x backward, causal
        shipped = flash_gluon.BWD_CONFIGS.get(d)
        flash = lambda q, k, v: flash_triton.FlashAttentionTriton.apply(q, k, v, True)  # noqa: E731
        rows = {"sdpa-cudnn": (_cudnn, None), "flash-triton, tl backward": (flash, None)}
        for c in CONFIGS[d]:
            rows[f"flash-triton, backward {name(c)}{' (shipped)' if c == shipped else ''}"] = (flash, c)
        try:
            for r in range(repeats):
                for label, (f, c) in rows.items():
                    flash_gluon.BWD_CONFIGS.pop(d, None)
                    if c is not None:
                        flash_gluon.BWD_CONFIGS[d] = c
                    ms = do_bench(lambda f=f: torch.autograd.grad(f(q, k, v), (q, k, v), do), warmup=10, rep=100)
                    print(f"| {d} | {r} | {label} | {ms:.3f} | {flops / ms / 1e9:.0f} |", flush=True)
        finally:
            flash_gluon.BWD_CONFIGS.pop(d, None)
            if shipped is not None:
                flash_gluon.BWD_CONFIGS[d] = shipped
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--against", metavar="FILE", help="an earlier flash_gluon.py to check and time beside")
    p.add_argument("--repeats", type=int, default=1, help="time the rows this many times, interleaved")
    p.add_argument("--d", default="64,128", help="head dims to time (comma-separated)")
    p.add_argument("--fwd-bwd", action="store_true", help="through autograd, each config as the shipped one")
    args = p.parse_args(argv)
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_only()
    if args.fwd_bwd:
        return through_autograd(args.repeats, [int(d) for d in args.d.split(",")])
    return check_and_time(args.against, args.repeats, [int(d) for d in args.d.split(",")])


if __name__ == "__main__":
    sys.exit(main())

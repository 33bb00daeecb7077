"""Sweep, check and compile lmsys.kernels.flash_gluon, the Gluon forward for Hopper (issue 12).

On a GPU: each config of SWEEP checked against float64 (awkward batch/heads, causal or not, both head
dims), then timed at the leaderboard shape beside sdpa-cudnn and flash-triton's tl forward, in one run.
On a CPU (--compile-only): every config of SWEEP compiled for sm_90 with the installed triton, with what
ptxas says of spills and of wgmma serialisation (C7514), which is what sank the first pipelined version.

    PYTHONPATH=src python scripts/gpu/gluon_attention.py --compile-only   # CPU, triton 3.6
    PYTHONPATH=src python scripts/gpu/gluon_attention.py                  # an H100/H200

With --against FILE (a flash_gluon.py of an earlier commit: `git show REV:src/lmsys/kernels/flash_gluon.py >
FILE`) that version's forward at its own shipped tiles is checked and timed in the same run, beside SWEEP.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from lmsys.kernels import flash_gluon
from lmsys.kernels.flash_gluon import Config, _attn_fwd_ws
PIPELINES = {0: "", 1: ", next QKᵀ under softmax", 2: ", FA3 order (QKᵀ and PV under softmax)"}
# Configs timed at the leaderboard shape: Config(BLOCK_M, BLOCK_N, STAGES, PIPELINE, warps, maxnreg, consumers)
# (the seventh session's wider sweep, one consumer, one warp group per CTA: docs/benchmarks/attention.md)
# next QKᵀ under the softmax (d 128's until the ninth session), FA3's order (shipped at d 64 and 128)
SWEEP = [Config(128, 128, 3, 1, 8, 168, 2), Config(128, 128, 3, 2, 8, 168, 2)]
# Configs checked against float64 (more shapes, fewer timings)
CHECKED = [Config(128, 128, 2, 2, 8, 168), Config(128, 128, 3, 1, 8, 168), Config(128, 128, 2, 0, 8, 168),
           Config(128, 64, 2, 2, 8, 168), Config(128, 128, 3, 1, 8, 168, 2), Config(128, 128, 3, 2, 8, 168, 2),
           Config(128, 128, 2, 0, 8, 168, 2), Config(128, 64, 3, 1, 8, 168, 2), Config(64, 128, 2, 1, 4, 128),
           Config(64, 128, 3, 2, 4, 128), Config(64, 64, 4, 2, 4, 128)]


def label(c: Config) -> str:
    return (f"{c.block_m}×{c.block_n}, {c.stages} st, {c.warps} warps"
            f"{', 2 consumers' if c.consumers == 2 else ''}{PIPELINES[c.pipeline]}")


def fits(c: Config, d: int) -> bool:
    """Whether Q and the K/V ring fit the 227 KiB of shared memory a block may use."""
    return 2 * d * (c.block_m + 2 * c.stages * c.block_n) <= 227 * 1024


def gluon_forward(q, k, v, causal: bool, config: Config):
    """(O, L) from the Gluon kernel at one config (shapes `flash_gluon.usable` takes)."""
    assert flash_gluon.usable(q, k, v, config)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    flash_gluon.forward(q, k, v, o, lse, causal, config)
    return o, lse


def load_against(path: str):
    """An earlier flash_gluon.py, imported as a module of its own (also used by gluon_backward.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flash_gluon_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look themselves up there)
    spec.loader.exec_module(module)
    return module


def against_forward(module, q, k, v, causal: bool):
    """(O, L) from an --against module's forward at its own shipped config."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    module.forward(q, k, v, o, lse, causal)
    return o, lse


def compile_only(args) -> int:
    """Compile every config of SWEEP for sm_90 on a machine without a GPU (Gluon needs no device to compile)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from compile_sm90 import compile_gluon, report

    ok = True
    for d in (64, 128):
        for c in SWEEP:
            if not fits(c, d):
                continue
            x = torch.empty(256, d, dtype=torch.bfloat16)
            example = [*flash_gluon.descriptors(x, x, x, c.block_m // c.consumers, c.block_n), x, torch.empty(1),
                       0.5, 256, 1, 1]
            warps = c.warps // c.consumers  # the launch's num_warps: the default partition's
            consts = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, HEAD_DIM=d, STAGES=c.stages, CAUSAL=True,
                          PIPELINE=c.pipeline, CONSUMERS=c.consumers, num_warps=warps)
            ok &= report(f"d {d}, {label(c)}, maxnreg {c.maxnreg}",
                         lambda: compile_gluon(_attn_fwd_ws, example, consts, num_warps=warps, maxnreg=c.maxnreg))
    return 0 if ok else 1


def check_and_time(args) -> int:
    from lmsys.bench.flash_check import reference_attention
    from lmsys.kernels.flash_triton import flash_forward

    against = load_against(args.against) if args.against else None
    torch.manual_seed(0)
    dev = "cuda"
    for (B, H, N, d, causal) in [(2, 3, 384, 64, True), (1, 2, 512, 128, True), (2, 2, 256, 128, False),
                                 (1, 4, 640, 64, False), (1, 2, 1536, 64, True), (1, 2, 1280, 128, True)]:
        q, k, v = (torch.randn(B, H, N, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        ref_o, ref_l = reference_attention(q, k, v, causal, device=dev)
        runs = {label(c): (lambda c=c: gluon_forward(q, k, v, causal, c)) for c in CHECKED if fits(c, d)}
        if against:
            runs[f"{os.path.basename(args.against)}, its own tiles"] = lambda: against_forward(against, q, k, v, causal)
        for what, run in runs.items():
            o, lse = run()
            err_o = ((o.double() - ref_o).norm() / ref_o.norm()).item()
            err_l = (lse.double() - ref_l).abs().max().item()
            ok = err_o < 1e-2 and err_l < 1e-2
            print(f"check B{B} H{H} N{N} d{d} causal {causal} {what}: O rel err {err_o:.2e}, "
                  f"L max abs err {err_l:.2e} {'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                return 1
    print("| d | impl | fwd ms | TFLOP/s |\n|---|---|---|---|")
    for d in (64, 128):
        B, H, N = 1, 16, 16384
        q, k, v = (torch.randn(B, H, N, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * B * H * N * N * d / 2
        impls = {"sdpa-cudnn": lambda: _cudnn(q, k, v), "flash-triton": lambda: flash_forward(q, k, v, True)}
        for c in SWEEP:
            if fits(c, d):
                impls[f"gluon {label(c)}"] = lambda c=c: gluon_forward(q, k, v, True, c)
        if against:
            impls[f"{os.path.basename(args.against)}, its own tiles"] = lambda: against_forward(against, q, k, v, True)
        for _ in range(args.repeats):  # interleaved: a host's drift shows as spread, not as a difference
            time_rows(d, impls, flops)
    return 0


def time_rows(d: int, rows: dict, flops: float) -> None:
    """One markdown row `| d | name | ms | TFLOP/s |` per callable (do_bench's median); a row that fails
    says why and the others still run. Also used by gluon_backward.py."""
    from triton.testing import do_bench

    for name, f in rows.items():
        try:
            ms = do_bench(f, warmup=25, rep=200)
            print(f"| {d} | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |", flush=True)
        except Exception as e:  # noqa: BLE001 - a row that fails says why
            print(f"| {d} | {name} | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)


def compare_policies(args) -> int:
    """flash-triton's forward and forward+backward with Policy.gluon off and on, beside sdpa-cudnn, at the
    leaderboard shape (bf16, causal, batch 1, 16 heads, seq 16384), interleaved `--repeats` times."""
    from dataclasses import replace

    from triton.testing import do_bench

    from lmsys.kernels import flash_triton

    print("| d | run | impl | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s |\n|---|---|---|---|---|---|")
    for d in (64, 128):
        q, k, v = (torch.randn(1, 16, 16384, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        flops = 4 * 16 * 16384 * 16384 * d / 2 * 3.5  # forward + 2.5x backward, causal
        impls = {"sdpa-cudnn": _cudnn}
        for name, gluon in (("flash-triton (tl forward)", False), ("flash-triton (gluon forward)", True)):
            impls[name] = (lambda q, k, v, gluon=gluon: flash_triton.FlashAttentionTriton.apply(
                q, k, v, True, None, replace(flash_triton.default_policy(), gluon=gluon)))
        for run in range(args.repeats):
            for name, f in impls.items():
                def step(f=f):
                    torch.autograd.grad(f(q, k, v), (q, k, v), do)
                with torch.no_grad():
                    fwd = do_bench(lambda f=f: f(q, k, v), warmup=25, rep=100)
                both = do_bench(step, warmup=10, rep=100)
                print(f"| {d} | {run} | {name} | {fwd:.3f} | {both:.3f} | {flops / both / 1e9:.0f} |", flush=True)
    return 0


def compare_strided(args) -> int:
    """The model's case (issue 12 item 4): q, k, v as strided views of one projection ([B, N, 3·H·d] seen as
    [B, H, N, d]), which the Gluon forward takes only as contiguous copies. flash-triton's tl forward on the
    views, the copies + the Gluon forward, and sdpa on the views, forward and forward+backward, at several
    sequence lengths (B·N = 65,536 tokens, 16 heads, bf16, causal), interleaved `--repeats` times: the
    measurement behind flash_triton.GLUON_COPY_MIN_KEYS."""
    from dataclasses import replace

    from triton.testing import do_bench

    from lmsys.kernels import flash_triton

    print("| d | N | run | impl | fwd ms | fwd+bwd ms |\n|---|---|---|---|---|---|")
    tl, copy = replace(flash_triton.default_policy(), gluon=False), flash_triton.default_policy()
    impls = {"sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
             "flash-triton, tl forward on the views": lambda q, k, v: flash_triton.FlashAttentionTriton.apply(
                 q, k, v, True, None, replace(tl, ran={})),
             "flash-triton, copies + Gluon forward": lambda q, k, v: flash_triton.FlashAttentionTriton.apply(
                 q, k, v, True, None, replace(copy, ran={}))}
    flash_triton.GLUON_COPY_MIN_KEYS = {64: 0, 128: 0}  # every length takes the copies in the last row
    for d in (64, 128):
        for n in (1024, 2048, 4096, 8192, 16384):
            b, h = 65536 // n, 16
            qkv = torch.randn(b, n, 3 * h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            q, k, v = qkv.view(b, n, 3 * h, d).transpose(1, 2).split(h, dim=1)
            do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
            for run in range(args.repeats):
                for name, f in impls.items():
                    with torch.no_grad():
                        fwd = do_bench(lambda f=f: f(q, k, v), warmup=10, rep=60)
                    both = do_bench(lambda f=f: torch.autograd.grad(f(q, k, v), qkv, do), warmup=5, rep=60)
                    print(f"| {d} | {n} | {run} | {name} | {fwd:.3f} | {both:.3f} |", flush=True)
    return 0


def _cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--policies", action="store_true", help="flash-triton with Policy.gluon off and on, fwd+bwd")
    p.add_argument("--strided", action="store_true", help="the model's strided q, k, v: tl forward against copies")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--against", metavar="FILE", help="an earlier flash_gluon.py to check and time beside")
    args = p.parse_args(argv)
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_only(args)
    if args.strided:
        return compare_strided(args)
    return compare_policies(args) if args.policies else check_and_time(args)


if __name__ == "__main__":
    sys.exit(main())

"""Host time of flash-triton at a launch-bound shape (the seed's b8 h1 s256 d64, bf16), piece by piece:
each row is µs per call, 500 calls, synchronised at the end (the GPU work is a few µs, so this is the
host: Python, Triton's autotuner and launcher, autograd). sdpa-cudnn and a bare one-line Triton kernel
are the references. Issue 12's "no regression at the seed's small shapes".

    PYTHONPATH=src python3 scripts/gpu/host_overhead.py [--profile]
"""

import cProfile
import pstats
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lmsys.kernels import flash_triton as ft


@triton.jit
def _touch(X):
    tl.store(X + tl.program_id(0), 1.0)


class _Plain(torch.autograd.Function):
    """The launchers under the smallest autograd.Function (four arguments, no policy): separates the
    library's Function from autograd's own cost."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        o, lse = ft.flash_forward(q, k, v, is_causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*ft.flash_backward(q, k, v, o, lse, do, ctx.is_causal), None)


def per_call(fn, n: int = 500) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    q, k, v = (torch.randn(8, 1, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = ft.flash_forward(q.detach(), k.detach(), v.detach())
    x = torch.zeros(1, device="cuda")

    def flash():
        ft.FlashAttentionTriton.apply(q, k, v, False).backward(do)

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v).backward(do)

    delta = torch.empty(8, 1, 256, device="cuda")

    def preprocess_then_backward():  # the launch that the dQ kernel now does on the way
        ft._attn_bwd_preprocess[(4, 1, 8)](o, do, delta, *o.stride()[:3], *do.stride()[:3], 1, 256, HEAD_DIM=64,
                                           HEAD_DIM_PAD=64, BLOCK_M=64)
        ft.flash_backward(q.detach(), k.detach(), v.detach(), o, lse, do)

    pieces = {
        "flash-triton forward + backward (autograd)": flash,
        "sdpa-cudnn forward + backward (autograd)": cudnn,
        "the launchers under a minimal autograd.Function": lambda: _Plain.apply(q, k, v, False).backward(do),
        "flash-triton forward + backward (autograd), again": flash,
        "flash_forward (one launch)": lambda: ft.flash_forward(q.detach(), k.detach(), v.detach()),
        "flash_backward (two launches: dQ with D folded in, then dK/dV)":
            lambda: ft.flash_backward(q.detach(), k.detach(), v.detach(), o, lse, do),
        "flash_backward after a preprocess launch (the earlier three-launch backward)": preprocess_then_backward,
        "bare Triton launch (one-line kernel)": lambda: _touch[(1,)](x),
        "torch add_ (one ATen launch)": lambda: x.add_(1.0),
    }
    print("| piece | µs per call |\n|---|---|")
    for name, fn in pieces.items():
        print(f"| {name} | {per_call(fn):.1f} |")
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            flash()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()

"""Host µs per attention call: flash-triton with its launch plans and without (LMSYS_FLASH_PLANS=0's path,
toggled in-process), beside SDPA's cuDNN and flash backends, forward alone and forward + backward.

Each number is the median over --calls calls of the time the host takes to issue the call, each call
started on an idle GPU (synchronized before it, not inside it: the time to issue, not to run), after 20
warm calls (compiles, the tuner, the first call's plan); `wall` is the same with the GPU's work waited for.
Then cProfile's top functions over 200 planned fwd+bwd calls of flash-triton at the first shape. The numbers
of 2026-12-05 (H100, the path before plans) and what the plans changed: docs/kernels.md, "Host overhead".
A device diagnostic, not part of the package. From the repository root, on a GPU machine:

    PYTHONPATH=src python3 scripts/host_overhead.py --shapes 8x1x256x64,8x1x1024x64,8x1x8192x64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from lmsys.kernels import plans
from lmsys.kernels.attention import attention


def host_us(impl: str, shape: tuple, causal: bool, backward: bool, calls: int) -> tuple[float, float]:
    """(median µs to issue one call, median µs to its end) on fresh random bf16 inputs."""
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def call():
        o = attention(q, k, v, causal, impl)
        if backward:
            torch.autograd.grad(o, (q, k, v), do)

    for _ in range(20):
        call()
    issue, wall = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        issue.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    return statistics.median(issue) * 1e6, statistics.median(wall) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x1x256x64,8x1x1024x64,8x1x8192x64,1x16x16384x64",
                        help="batch x heads x seq x d, comma-separated")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    import triton

    print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = [("flash-triton", True), ("flash-triton", False), ("sdpa-cudnn", True), ("sdpa-flash", True)]
    print(f"{'shape':20} {'causal':6} {'impl':24} {'fwd host':>9} {'fwd wall':>9} {'f+b host':>9} {'f+b wall':>9}  (µs)")
    for shape in shapes:
        for causal in (True, False):
            for impl, planned in rows:
                plans.ENABLED = planned
                try:
                    f = host_us(impl, shape, causal, False, args.calls)
                    b = host_us(impl, shape, causal, True, args.calls)
                finally:
                    plans.ENABLED = True
                label = impl + ("" if impl != "flash-triton" else " (plans)" if planned else " (no plans)")
                print(f"{'x'.join(map(str, shape)):20} {causal!s:6} {label:24} {f[0]:9.1f} {f[1]:9.1f} "
                      f"{b[0]:9.1f} {b[1]:9.1f}", flush=True)
    print(f"plans: {plans.STATS}")
    if args.profile:
        q, k, v = (torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        for _ in range(20):
            torch.autograd.grad(attention(q, k, v, True, "flash-triton"), (q, k, v), do)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200):
            torch.autograd.grad(attention(q, k, v, True, "flash-triton"), (q, k, v), do)
        profiler.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue()[:6000])


if __name__ == "__main__":
    main()

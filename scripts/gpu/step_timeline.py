"""One forward+backward step of the bench's loop (lmsys bench attention: forward, then
torch.autograd.grad, no synchronisation between steps) as the GPU ran it: each kernel's start, duration
and the idle gap before it, for flash-triton and sdpa-cudnn at the leaderboard shape. The sum of kernel
times against the step's span shows what the bench's CUDA events count beyond the kernels.

    PYTHONPATH=src python3 scripts/gpu/step_timeline.py [--d 128]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from lmsys.kernels.attention import attention


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    shape = (1, 16, 16384, args.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    for impl in ("sdpa-cudnn", "flash-triton"):
        def step():
            out = attention(q, k, v, True, impl)
            torch.autograd.grad(out, (q, k, v), do)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        per_step = len(kernels) // args.steps
        last = kernels[-per_step:]
        span = (last[-1].time_range.end - last[0].time_range.start) / 1000
        busy = sum(e.time_range.end - e.time_range.start for e in last) / 1000
        period = (kernels[-1].time_range.end - kernels[-per_step * (args.steps - 1)].time_range.start) / 1000 \
            / (args.steps - 1)
        print(f"\n## {impl}, d {args.d}: {per_step} kernels per step, step span {span:.3f} ms, kernels {busy:.3f} ms, "
              f"period over the last {args.steps - 1} steps {period:.3f} ms")
        print("| kernel | start ms | ms | gap before µs |\n|---|---|---|---|")
        t0, prev = last[0].time_range.start, None
        for e in last:
            gap = "" if prev is None else f"{(e.time_range.start - prev) :.1f}"
            print(f"| {e.name[:60]} | {(e.time_range.start - t0) / 1000:.3f} | "
                  f"{(e.time_range.end - e.time_range.start) / 1000:.3f} | {gap} |")
            prev = e.time_range.end
        cpu = [e for e in prof.events() if e.name in ("autograd::engine::evaluate_function: FlashAttentionTritonBackward",
                                                       "FlashAttentionTritonBackward", "FlashAttentionTriton")]
        for e in cpu[-2:]:
            print(f"host: {e.name} {(e.time_range.end - e.time_range.start) / 1000:.3f} ms")


if __name__ == "__main__":
    main()

"""What a transfer beside matrix products costs them, on one GPU (issue 11 item 4's question in small):
bf16 matmuls (8192³) timed alone, then with a side stream that keeps moving 400 MiB buffers by
(a) cudaMemcpyAsync device-to-device (`copy_`: copy engines or the driver's copy kernel), (b) an SM
kernel that reads two buffers and writes one (`add_`, like NCCL's reduction), each for the whole
matmul loop. Prints the matmul time and the side stream's bandwidth for each.

Then issue 15's question: the master-weight AdamW kernel (lmsys.kernels.adamw, 32 launches of 105 M
elements: one 2.7b step's worth) on a side stream beside backward-sized matmuls (2048 × 2560 @ 2560 ×
10240 bf16), with the matmuls leaving 0–48 SMs (`MatmulCarveout`), and the side stream at normal or
high priority. "saved" is (default matmuls alone + AdamW alone) − (both together): what overlap buys.

    PYTHONPATH=src python3 scripts/gpu/overlap_probe.py [--capped]

`--capped` runs only the AdamW part with the kernel kept to a few CTAs (`programs`), 1, 2 or 4 per SM
left free, instead of the first two tables.
"""

from __future__ import annotations

import sys

import torch

N, REPS, MIB = 8192, 40, 2**20


def timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> None:
    a, b = (torch.randn(N, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    src, dst = (torch.randn(400 * MIB // 4, device="cuda") for _ in range(2))
    side = torch.cuda.Stream()

    def matmuls():
        for _ in range(REPS):
            a @ b

    def beside(op):  # keep the side stream busy for longer than the matmuls, count what it moved
        moved = 0
        with torch.cuda.stream(side):
            done = torch.cuda.Event(enable_timing=True)
            first = torch.cuda.Event(enable_timing=True)
            first.record(side)
            for _ in range(250):  # ~100 ms of transfers: longer than the matmul loop
                op()
                moved += src.numel() * src.element_size()
            done.record(side)
        return first, done, moved

    ops = {"copy_ (cudaMemcpyAsync D2D)": lambda: dst.copy_(src), "add_ (SM kernel)": lambda: dst.add_(src)}
    matmuls()
    torch.cuda.synchronize()
    alone = sorted(timed(matmuls) for _ in range(3))[1]
    flops = 2 * N**3 * REPS
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| side stream | matmul ms (40 × 8192³ bf16) | TFLOP/s | vs alone | side GB/s |")
    print("|---|---|---|---|---|")
    print(f"| none | {alone:.1f} | {flops / alone / 1e9:.0f} | 1.00 | — |")
    for name, op in ops.items():
        for _ in range(2):
            op()
        torch.cuda.synchronize()
        first, done, moved = beside(op)
        ms = timed(matmuls)
        done.synchronize()
        side_ms = first.elapsed_time(done)
        print(f"| {name} | {ms:.1f} | {flops / ms / 1e9:.0f} | {ms / alone:.2f} | {moved / side_ms / 1e6:.0f} |")


def adamw_beside_matmuls() -> None:
    from lmsys.core.devices import MatmulCarveout
    from lmsys.kernels.adamw import adamw_update_

    x = torch.randn(2048, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, 10240, device="cuda", dtype=torch.bfloat16)
    n = 105_000_000
    p, g = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    master, m, v = torch.randn(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    kw = dict(step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def matmuls():
        for _ in range(175):
            x @ w

    def adamw(programs=None):
        for _ in range(32):
            adamw_update_(p, g, master, m, v, programs=programs, **kw)

    def both(side, programs=None):
        ready = torch.cuda.current_stream().record_event()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            adamw(programs)
        matmuls()
        torch.cuda.current_stream().wait_stream(side)

    def median(fn):
        fn()
        torch.cuda.synchronize()
        return sorted(timed(fn) for _ in range(5))[2]

    t_adamw = median(adamw)
    print(f"\nAdamW alone: {t_adamw:.2f} ms ({32 * n * 28 / t_adamw / 1e6:.0f} GB/s)")
    if "--capped" in sys.argv:
        return capped(matmuls, adamw, both, median, t_adamw, 32 * n * 28)
    print("| matmuls leave SMs | side priority | matmuls alone ms | both ms | saved ms | saved % of AdamW |")
    print("|---|---|---|---|---|---|")
    for priority in (0, -1):
        side = torch.cuda.Stream(priority=priority)
        for sms in (None, 0, 8, 16, 32, 48):
            carve = MatmulCarveout(sms or 0, "cuda")
            if sms is not None:
                carve.on()
            try:
                t_mm = median(matmuls)
                t_both = median(lambda: both(side))
            finally:
                carve.off()
            if sms is None:
                t_default = t_mm  # the serial reference: default matmuls, then AdamW
            saved = t_default + t_adamw - t_both
            print(f"| {'—' if sms is None else sms} | {'high' if priority else 'normal'} | {t_mm:.2f} | "
                  f"{t_both:.2f} | {saved:.2f} | {100 * saved / t_adamw:.0f} |")


def capped(matmuls, adamw, both, median, t_adamw, nbytes) -> None:
    """AdamW kept to `programs` CTAs (a grid-stride loop) on a high-priority side stream, beside matmuls
    that leave `sms` SMs: the updates can then only take the SMs left to them."""
    from lmsys.core.devices import MatmulCarveout

    t_default = median(matmuls)
    side = torch.cuda.Stream(priority=-1)
    print(f"matmuls alone (default cuBLAS): {t_default:.2f} ms")
    print("| matmuls leave SMs | AdamW CTAs | AdamW alone ms | AdamW alone GB/s | matmuls alone ms | both ms "
          "| saved ms | saved % of AdamW |")
    print("|---|---|---|---|---|---|---|---|")
    for sms in (8, 16, 24, 32):
        for per_sm in (1, 2, 4):
            programs = sms * per_sm
            t_alone = median(lambda: adamw(programs))
            carve = MatmulCarveout(sms, "cuda")
            carve.on()
            try:
                t_mm = median(matmuls)
                t_both = median(lambda: both(side, programs))
            finally:
                carve.off()
            saved = t_default + t_adamw - t_both
            print(f"| {sms} | {programs} | {t_alone:.2f} | {nbytes / t_alone / 1e6:.0f} | {t_mm:.2f} | "
                  f"{t_both:.2f} | {saved:.2f} | {100 * saved / t_adamw:.0f} |")


if __name__ == "__main__":
    if "--capped" not in sys.argv:
        main()
    adamw_beside_matmuls()

"""What a transfer beside matrix products costs them, on one GPU (issue 11 item 4's question in small):
bf16 matmuls (8192³) timed alone, then with a side stream that keeps moving 400 MiB buffers by
(a) cudaMemcpyAsync device-to-device (`copy_`: copy engines or the driver's copy kernel), (b) an SM
kernel that reads two buffers and writes one (`add_`, like NCCL's reduction), each for the whole
matmul loop. Prints the matmul time and the side stream's bandwidth for each.

    PYTHONPATH=src python3 scripts/gpu/overlap_probe.py
"""

from __future__ import annotations

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


if __name__ == "__main__":
    main()

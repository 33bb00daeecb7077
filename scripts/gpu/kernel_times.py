"""Per-kernel device times of flash-triton's and cuDNN's backward at the leaderboard shape (bf16, causal,
batch 1, 16 heads, seq 16384, d 64 and 128), from torch.profiler over 20 calls: which of flash-triton's two
kernels (dK/dV, dQ) loses to cuDNN's one, and what cuDNN launches.

    PYTHONPATH=src python3 scripts/gpu/kernel_times.py
"""
import torch
from torch.profiler import ProfilerActivity, profile
from torch.nn.attention import SDPBackend, sdpa_kernel
from lmsys.kernels import flash_triton

print("| d | impl | kernel | calls | ms per call |\n|---|---|---|---|---|")
for d in (64, 128):
    q, k, v, do = (torch.randn(1, 16, 16384, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = flash_triton.flash_forward(q, k, v, True)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    runs = {"flash-triton": lambda: flash_triton.flash_backward(q, k, v, o, lse, do, True),
            "cudnn": lambda: torch.autograd.grad(out, (qr, kr, vr), do, retain_graph=True)}
    for name, f in runs.items():
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                f()
            torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[:6]:
            print(f"| {d} | {name} | {e.key[:70]} | {e.count} | {e.device_time_total / e.count / 1000:.3f} |", flush=True)

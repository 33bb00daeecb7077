"""Does triton 3.6 compile the flash-triton forward with tensor-descriptor loads *and* warp specialisation
on Hopper, config by config, and is it faster? (issue 12: the one handle triton gives on FA3's
producer/consumer warp groups). bf16, causal, b1 h16 s16384, forward only, do_bench median; each config
is forced (Policy(pick=i)); a compile failure is a row, not the end.

    PYTHONPATH=src python3 scripts/gpu/ws_tma_probe.py
"""

from __future__ import annotations

import torch
import triton
from flash_levers import sdpa  # this folder's levers script: SDPA with one backend, causal

from lmsys.core.flops import attention_flops
from lmsys.kernels import flash_triton as ft

B, H, S = 1, 16, 16384


def forward_ms(fn, q, k, v) -> float:
    return triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100)


def main() -> None:
    ft.WARP_SPEC_WITH_TMA = True
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"bf16 causal b{B} h{H} s{S}; forward, do_bench median")
    print("| d | variant | config | fwd ms | fwd TFLOP/s | max err vs sdpa |")
    print("|---|---|---|---|---|---|")
    for d in (64, 128):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        flops = attention_flops(batch=B, heads=H, n_queries=S, n_keys=S, d_head=d, causal=True, direction="fwd")
        cudnn = sdpa("CUDNN_ATTENTION")
        ref = cudnn(q, k, v)
        ms = forward_ms(cudnn, q, k, v)
        print(f"| {d} | sdpa-cudnn | | {ms:.3f} | {flops / ms / 1e9:.0f} | |", flush=True)
        fitting = ft.fitting_configs("fwd", ft.CONFIGS["fwd"], d_pad=d, elem=2, smem=ft.shared_memory("cuda"))
        for i, config in enumerate(fitting[:3]):  # the autotuner's picks at d 64 and 128 are among these
            for label, change in (("pointer", {}), ("tma", {"tma": True}),
                                  ("tma + warp_specialize", {"tma": True, "warp_specialize": True})):
                policy = ft.Policy(pick=i, **change)

                def run(q, k, v, policy=policy):
                    return ft.flash_forward(q, k, v, True, policy=policy)[0]

                try:
                    err = (run(q, k, v).float() - ref.float()).abs().max().item()
                    ms = forward_ms(run, q, k, v)
                    print(f"| {d} | {label} | {config} | {ms:.3f} | {flops / ms / 1e9:.0f} | {err:.1e} |", flush=True)
                except Exception as exc:  # a compile failure of this config: say so and go on
                    print(f"| {d} | {label} | {config} | failed: {type(exc).__name__}: {str(exc)[:80]} | | |",
                          flush=True)


if __name__ == "__main__":
    main()

"""Per-config kernel times the autotuner measures for flash-triton on the issue's shapes.

    PYTHONPATH=src python3 scripts/gpu/attention_configs.py [--d-head 64,128] [--seq-len 16384] [--explore]
    PYTHONPATH=src python3 scripts/gpu/attention_configs.py --explore --compile-slice 3/8   # warm the cache only
    PYTHONPATH=src python3 scripts/gpu/attention_configs.py --compile-slice 0/8 --dtype fp32,bf16 \
        --d-head 16,32,64,128 --seq-len 256 --causal no      # warm the cache for the seed's sweep

Runs forward+backward per shape (bf16, causal, batch 1, 16 heads), then prints, for each of the three
autotuned kernels, every config it timed (median ms by Triton's do_bench) and the one it chose. With
--explore the kernels get a wider config list than the shipped one (to choose that list from data);
--compile-slice i/n only compiles every n-th of those configs (run n of them in parallel first, so that
the timing process finds every kernel in Triton's cache).
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from lmsys.core.flops import attention_flops
from lmsys.kernels import flash_triton as ft

WIDE = {  # (BLOCK_M, BLOCK_N, warps, stages)
    "fwd": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 8, 2), (128, 64, 4, 3), (128, 128, 8, 3),
            (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4), (128, 32, 4, 3), (64, 128, 4, 3)],
    "dkdv": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 64, 8, 3), (64, 128, 8, 3), (64, 128, 8, 2),
             (32, 128, 4, 3), (32, 128, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2), (32, 64, 4, 4), (16, 64, 4, 4)],
    "dq": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2),
           (128, 128, 8, 2), (64, 128, 4, 3), (64, 128, 8, 3), (128, 32, 4, 4)],
}
TUNERS = {"fwd": ft._attn_fwd, "dkdv": ft._attn_bwd_dkdv, "dq": ft._attn_bwd_dq}


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _configs(kernel: str) -> list:
    return [ft._config(*c) for c in WIDE[kernel]]


def _step(seq: int, d: int, heads: int, causal: bool, dtype=torch.bfloat16) -> None:
    q, k, v = (torch.randn(1, heads, seq, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    out = ft.FlashAttentionTriton.apply(q, k, v, causal)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()


def compile_slice(index: int, count: int, shapes, heads: int, causals, dtypes, explore: bool) -> None:
    """Compile (and run once) every count-th (kernel, config, shape, dtype, causal) combination, one config
    at a time: the wide list with explore, else the shipped configs the autotuner would try."""
    jobs = []
    for kernel, (seq, d), dtype, causal in itertools.product(WIDE, shapes, dtypes, causals):
        configs = _configs(kernel) if explore else ft.fitting_configs(
            kernel, ft.CONFIGS[kernel], d_pad=ft.head_dim_pad(d), elem=DTYPES[dtype].itemsize,
            smem=ft.shared_memory("cuda"))
        jobs += [(kernel, config, seq, d, dtype, causal) for config in configs]
    os.environ["LMSYS_FLASH_AUTOTUNE"] = "0"  # each job runs its one config
    for kernel, config, seq, d, dtype, causal in jobs[index::count]:
        for name, tuner in TUNERS.items():
            tuner.cache = {}
            tuner.configs = [config] if name == kernel else list(ft.CONFIGS[name])
        try:
            _step(seq, d, heads, causal, DTYPES[dtype])
        except Exception as exc:  # noqa: BLE001 - out of resources: the timing run records it as inf
            print(f"{kernel} {config} d{d} {dtype}: {type(exc).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d-head", default="64,128")
    parser.add_argument("--seq-len", default="16384")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--explore", action="store_true")
    parser.add_argument("--compile-slice", default=None)
    parser.add_argument("--dtype", default="bf16", help="with --compile-slice: comma-separated dtypes")
    parser.add_argument("--causal", default="yes", help="with --compile-slice: yes, no or both")
    args = parser.parse_args()
    causal = not args.no_causal
    shapes = list(itertools.product(map(int, args.seq_len.split(",")), map(int, args.d_head.split(","))))
    if args.compile_slice:
        index, count = map(int, args.compile_slice.split("/"))
        causals = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
        compile_slice(index, count, shapes, args.heads, causals, args.dtype.split(","), args.explore)
        return
    if args.explore:
        for name, tuner in TUNERS.items():
            tuner.configs = _configs(name)
    for seq, d in shapes:
        for tuner in TUNERS.values():
            tuner.cache = {}
        _step(seq, d, args.heads, causal)
        fwd = attention_flops(batch=1, heads=args.heads, n_queries=seq, n_keys=seq, d_head=d, causal=causal,
                              direction="fwd")
        print(f"== seq {seq}, d {d}, causal {causal}, bf16, b1 h{args.heads}")
        # matmul work actually done: fwd 2 products, dK/dV 4, dQ 3 (each 2·b·h·s²·d, halved when causal)
        for name, flops in (("fwd", fwd), ("dkdv", 2 * fwd), ("dq", 1.5 * fwd)):
            tuner = TUNERS[name]
            timings = getattr(tuner, "configs_timings", None) or {}
            best = getattr(tuner, "best_config", None)
            for config, t in sorted(timings.items(), key=lambda kv: _ms(kv[1])):
                mark = "*" if str(config) == str(best) else " "
                c = config
                label = f"BM {c.kwargs['BLOCK_M']:3d} BN {c.kwargs['BLOCK_N']:3d} w{c.num_warps} s{c.num_stages}"
                print(f"  {mark} {name:5s} {label}  {_ms(t):8.3f} ms  {flops / _ms(t) / 1e9:6.0f} TFLOP/s (matmul work)")
            if not timings:
                print(f"    {name}: no timings (one config): {best}")


def _ms(t) -> float:
    return float(t[0] if isinstance(t, (list, tuple)) else t)


if __name__ == "__main__":
    main()

"""The speed levers of flash-triton (issue 12), one at a time, on one GPU: bf16, causal, batch 1, 16 heads,
seq 16384, d 64 and d 128; forward and forward+backward with triton.testing.do_bench (median ms) and
TFLOP/s (4·b·h·s²·d forward, 2.5× that backward, halved when causal: lmsys.core.flops.attention_flops).

Rows: sdpa-cudnn, sdpa-flash, flash-triton as shipped (default_policy(), autotuned: on Hopper at d 128 its
forward and backward are the Gluon kernels), the same with the tl kernels (gluon=False, deterministic=True),
then each lever flipped from the latter alone, at the tiles the autotuner chose (one compile per kernel,
no re-tuning):
deterministic (one backward launch, atomic dQ), tma (tensor-descriptor loads in the forward), tma_backward
(in both backward kernels), warp_specialize, persistent (forward grid of one program per SM, causal tiles
heaviest first); "atomic": the one-launch backward autotuned, dQ by TMA reduce-adds and by element-wise
atomics (flash_triton.TMA_REDUCE_DQ); then the wide-tile configs (d 64, each picked in turn), then the
backward tiles of BWD_TILES (dK/dV and dQ kernels, the forward at its tuned tile), then the best
combination of what helped. --levers picks which of these rows run. Every variant is first checked against SDPA
(max relative error of O, dQ, dK, dV) at b1 h4 s1031. Then d 80 and GQA (Hkv 4 of 16) against SDPA.

    PYTHONPATH=src python3 scripts/gpu/flash_levers.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton

from lmsys.core.flops import attention_flops
from lmsys.kernels import flash_triton as ft

B, H, S = 1, 16, 16384
# (BLOCK_M, BLOCK_N, warps, stages) of the dK/dV and dQ kernels for the "bwd-tiles" lever: the Triton
# tutorial's Hopper choice (narrow streamed side, 5 stages) and neighbours of it
BWD_TILES = [((32, 128, 4, 5), (128, 32, 4, 5)), ((32, 128, 4, 4), (128, 32, 4, 4)),
             ((32, 128, 8, 5), (128, 32, 8, 5)), ((64, 128, 8, 4), (128, 64, 8, 4)),
             ((64, 64, 4, 5), (64, 64, 4, 5)), ((32, 64, 4, 5), (64, 32, 4, 5))]
LINES: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def sdpa(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])

    return run


def triton_impl(policy):
    def run(q, k, v):
        return ft.FlashAttentionTriton.apply(q, k, v, True, None, policy)

    return run


def inputs(h, hkv, s, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    return q, k, v, torch.randn_like(q)


def rel_err(fn, d, hkv) -> float:
    """max over O, dQ, dK, dV of max|x - sdpa| / max|sdpa| at b1 h4 s1031 (SDPA's math backend in fp32)."""
    q, k, v, do = inputs(4, max(1, 4 * hkv // H), 1031, d, seed=1)
    out = fn(q, k, v)
    got = (out, *torch.autograd.grad(out, (q, k, v), do))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref_o = sdpa("MATH")(q32, k32, v32)
    ref = (ref_o, *torch.autograd.grad(ref_o, (q32, k32, v32), do.float()))
    return max(((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))


def measure(name, fn, d, hkv=H):
    try:
        err = rel_err(fn, d, hkv)
        q, k, v, do = inputs(H, hkv, S, d)
        fwd = triton.testing.do_bench(lambda: fn(q, k, v), return_mode="median")
        both = triton.testing.do_bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), return_mode="median")
    except Exception as exc:  # noqa: BLE001 - a lever triton cannot compile here is a result, not a crash
        say(f"| {name} | {d} | {hkv} | — | — | — | — | {type(exc).__name__}: {str(exc).splitlines()[0][:80]} |")
        return None
    flops = {m: attention_flops(batch=B, heads=H, n_queries=S, n_keys=S, d_head=d, causal=True, direction=m)
             for m in ("fwd", "fwd+bwd")}
    say(f"| {name} | {d} | {hkv} | {fwd:.3f} | {flops['fwd'] / fwd / 1e9:.0f} | {both:.3f} | "
        f"{flops['fwd+bwd'] / both / 1e9:.0f} | {err:.1e} |")
    return fwd, both


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--d-head", default="64,128")
    parser.add_argument("--levers",
                        default="deterministic,atomic,tma,tma_backward,warp_specialize,persistent,wide,bwd-tiles",
                        help="which lever rows to measure (the shipped and SDPA rows always run)")
    args = parser.parse_args()
    chosen = set(args.levers.split(","))
    t0 = time.time()
    say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"bf16 causal b{B} h{H} s{S}; do_bench median")
    say("")
    say("| variant | d | kv heads | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | rel err vs SDPA |")
    say("|---|---|---|---|---|---|---|---|")
    for d in map(int, args.d_head.split(",")):
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            measure(f"sdpa-{'cudnn' if backend.startswith('CUDNN') else 'flash'}", sdpa(backend), d)
        measure("flash-triton (autotuned, default policy)", triton_impl(ft.default_policy()), d)
        # the levers below are the tl kernels': measured from the default policy with the tl forward (where the
        # Gluon forward runs, the tl forward's levers do not apply), which also tunes that forward
        shipped = replace(ft.default_policy(), gluon=False, deterministic=True)  # the tl kernels throughout
        base = measure("flash-triton, tl forward (gluon=False, autotuned)", triton_impl(shipped), d)
        tuned = {name: [tuner.best_config] for name, tuner in ft._tuners().items()}  # the tiles it chose
        fixed = replace(shipped, pick=0, configs=tuned, ran={})
        # each lever flipped from the default policy, alone, at the tiles the autotuner chose
        levers = {f"{name}={not getattr(shipped, name)}": {name: not getattr(shipped, name)}
                  for name in ("deterministic", "tma", "tma_backward", "warp_specialize", "persistent")
                  if name in chosen}
        helped = {}
        at = f"@ {shipped.ran.get('fwd')}/{shipped.ran.get('dkdv')}/{shipped.ran.get('dq')}"
        for label, change in levers.items():
            got = measure(f"{label} {at}", triton_impl(replace(fixed, ran={}, **change)), d)
            if got and base and got[1] < 0.99 * base[1] or got and base and got[0] < 0.99 * base[0]:
                helped.update(change)
        if "atomic" in chosen:  # the one-launch backward autotuned, dQ by TMA reduce-adds, then by atomics
            for reduce in (True, False):
                ft.TMA_REDUCE_DQ = reduce
                atomic = replace(shipped, deterministic=False, ran={})
                got = measure(f"deterministic=False (autotuned), dQ by {'TMA reduce-add' if reduce else 'atomics'}"
                              f"{'' if shipped.tma_backward else ' (tma_backward off: atomics)'}",
                              triton_impl(atomic), d)
                say(f"<!-- tiles {atomic.ran} -->")
                if reduce and got and base and got[1] < 0.99 * base[1]:
                    helped.update(deterministic=False)
            ft.TMA_REDUCE_DQ = True
        best_wide = None
        if d == 64 and "wide" in chosen:
            wide = {name: ft.WIDE_CONFIGS[name] + tuned[name] for name in tuned}
            for i in range(len(ft.WIDE_CONFIGS["fwd"])):
                policy = replace(shipped, pick=i, configs=wide, ran={})
                got = measure(f"+ wide tiles #{i}", triton_impl(policy), d)
                if got and base and got[1] < 0.99 * base[1] and (best_wide is None or got[1] < best_wide[0]):
                    best_wide = (got[1], i, dict(policy.ran))
            if best_wide:
                say(f"<!-- best wide tiles d64: #{best_wide[1]} {best_wide[2]} -->")
        if "bwd-tiles" in chosen:  # backward tiles and deeper pipelines, the forward kept at its tuned tile
            for dkdv, dq in BWD_TILES:
                policy = replace(shipped, pick=0, ran={}, configs={"fwd": tuned["fwd"], "dkdv": [ft._config(*dkdv)],
                                                                   "dq": [ft._config(*dq)]})
                measure(f"+ bwd tiles dkdv {dkdv} dq {dq}", triton_impl(policy), d)
        combo = replace(fixed, **({"pick": best_wide[1], "configs": wide} if best_wide else {}), ran={}, **helped)
        measure(f"best combination {helped or '(none helped)'}{' + wide #%d' % best_wide[1] if best_wide else ''}",
                triton_impl(combo), d)
        say(f"<!-- d {d} done at {time.time() - t0:.0f} s -->")
    for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
        measure(f"sdpa-{'cudnn' if backend.startswith('CUDNN') else 'flash'}", sdpa(backend), 80)
    measure("flash-triton (autotuned)", triton_impl(ft.default_policy()), 80)
    for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
        measure(f"sdpa-{'cudnn' if backend.startswith('CUDNN') else 'flash'} enable_gqa", sdpa(backend), 128, hkv=4)
    measure("flash-triton GQA (autotuned)", triton_impl(ft.default_policy()), 128, hkv=4)
    say(f"<!-- total {time.time() - t0:.0f} s -->")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()

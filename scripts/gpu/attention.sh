#!/usr/bin/env bash
# FlashAttention-2 on one GPU (kind nvidia-h200), from the repository root: `bash scripts/gpu/attention.sh`.
# PARTS picks the steps (default "tests check leaderboard levers"), in this order:
#   tests        the flash kernels' tests on the GPU (gpu-marked ones included) -> $OUT/pytest.txt, then
#                every other gpu-marked test -> $OUT/pytest_gpu.txt
#   check        lmsys flash check on cuda (flash-triton; flash-torch) -> check.md
#   leaderboard  bf16 causal b1 h16 s16384, d 64 and d 128: SDPA's flash and cuDNN backends against flash-triton
#   levers       flash-triton's levers at that shape, each from the tl kernels (gluon off, deterministic
#                backward) as its own row, beside cuDNN (`bench attention --policy`); then d 80 and GQA (4 kv heads)
#   long         seq 16384, 32768, 65536 (d 64, b1 h16, bf16 causal): time and peak memory
#   seed         the seed's sweep (b8 h1, d 16..128, seq 256..16384), fp32 and bf16, naive/compiled/flash-triton
#   table        issue 43's table: the seed's sweep in bf16 (causal and not; flash-triton, sdpa-cudnn, sdpa-flash)
#                REPEATS times (default 3) -> table_bf16_{causal,full}_N.json, and in fp32 (flash-triton,
#                sdpa-efficient, compiled) FP32_REPEATS times (default 1) -> table_fp32_N.json, with plots
#   short        the backward at b8 h1 s8192 d64 bf16 causal: flash-triton's levers beside cuDNN, and the
#                profiler's kernels of one fwd+bwd of each (grid, ms) -> short.md, short_kernels.txt
#   host         per-call host µs (issue 43 item 3): `bench attention` at b8 h1, 256 to 4,096 keys, d 16/64/128,
#                causal and not, flash-triton's host-bound dispatch (Policy.host_bound_flops) beside the path
#                before it (0) and a threshold 4x higher, sdpa-cudnn and sdpa-flash; the leaderboard -> host.md
#   hostprof     host_profile.txt: host µs of a warm fwd+bwd at 256 keys causal and not, flash-triton's paths beside
#                SDPA's and an empty autograd.Function, interleaved; the plans' hits, cProfile's top 14 (also run by host)
#   byo          issue 41: flash check --adapters with the CS336-layout fixtures (Triton compiled), and the
#                planted missing scale -> byo.md
# Every command is time-guarded (scripts/gpu/lib.sh; BUDGET default 560 s; DRY_RUN=1 prints them); each
# table goes to $OUT/<part>.md under the command that printed it, the log to $OUT/attention.log.
set -u
BUDGET=${BUDGET:-560}; source scripts/gpu/lib.sh
PARTS=${PARTS:-tests check leaderboard levers}
BOARD="bench attention --device cuda --preset leaderboard --warmup 5 --steps 30"
TL="gluon=false,deterministic=true"  # the tl kernels, from which each lever is flipped alone
run() {  # run FILE lmsys-args: the table under its command in $OUT/FILE (nothing written when skipped)
  local file=$1; shift
  if have_time; then { md "$@"; L "$@" -f md; } >> "$OUT/$file"; else L "$@"; fi
}
{
date -u; env_line; echo "parts: $PARTS, budget ${BUDGET}s"
if part tests; then
  # one config per kernel unless a test picks its own (compile time), 8 workers; then every other gpu test
  LMSYS_FLASH_AUTOTUNE=0 T=300 X python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_flash_triton.py \
    tests/test_flash_torch.py tests/test_flash_plans.py > "$OUT/pytest.txt" 2>&1
  tail -n 3 "$OUT/pytest.txt"
  T=150 X python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fast_kernels.py tests/test_optimizer_in_backward.py \
    tests/test_profile_memory.py tests/test_distributed_gpu.py > "$OUT/pytest_gpu.txt" 2>&1
  tail -n 3 "$OUT/pytest_gpu.txt"
fi
if part check; then
  T=250 run check.md flash check --device cuda --cases "${CASES:-24}" --seed 0
  T=60 run check.md flash check --device cuda --impl flash-torch --cases 6 --seed 1
fi
if part leaderboard; then
  T=90 run leaderboard.md $BOARD --impl sdpa-flash,sdpa-cudnn,flash-triton
  T=60 run leaderboard.md $BOARD --impl sdpa-flash,sdpa-cudnn,flash-triton --d-head 128
fi
if part levers; then
  for d in 64 128; do
    T=200 run levers.md $BOARD --impl sdpa-cudnn,flash-triton --d-head $d --policy "$TL" \
      --policy "$TL,deterministic=false" --policy "$TL,tma=true" --policy "$TL,tma_backward=false" \
      --policy "$TL,warp_specialize=true" --policy "$TL,persistent=true"
  done
  T=60 run levers.md $BOARD --impl sdpa-flash,sdpa-cudnn,flash-triton --d-head 80
  T=60 run levers.md $BOARD --impl sdpa-flash,sdpa-cudnn,flash-triton --heads 16 --kv-heads 4
fi
if part long; then
  T=150 run long.md $BOARD --impl flash-triton --context-length 16384,32768,65536 --warmup 2 --steps 10
fi
if part seed; then
  for dt in fp32 bf16; do
    T=200 run seed.md bench attention --device cuda --impl naive,compiled,flash-triton --dtype $dt
  done
fi
if part table; then
  SEED="bench attention --device cuda --warmup ${WARMUP:-5} --steps ${STEPS:-30}"
  for r in $(seq 1 "${REPEATS:-3}"); do
    T=150 L $SEED --dtype bf16 --causal --impl flash-triton,sdpa-cudnn,sdpa-flash -q -o "$OUT/table_bf16_causal_$r.json" \
      --plot "$OUT/table_bf16_causal_$r.png" > /dev/null
    T=150 L $SEED --dtype bf16 --no-causal --impl flash-triton,sdpa-cudnn,sdpa-flash -q -o "$OUT/table_bf16_full_$r.json" > /dev/null
  done
  for r in $(seq 1 "${FP32_REPEATS:-1}"); do
    T=240 L $SEED --dtype fp32 --impl flash-triton,sdpa-efficient,compiled -q -o "$OUT/table_fp32_$r.json" > /dev/null
  done
fi
if part short; then
  SHORT="bench attention --device cuda --dtype bf16 --causal --batch-size 8 --heads 1 --context-length 8192 --d-head 64 --warmup 5 --steps 30"
  T=150 run short.md $SHORT --impl sdpa-cudnn,flash-triton --policy deterministic=true --policy deterministic=false \
    --policy gluon=false --policy gluon=false,deterministic=true --policy gluon=false,deterministic=false \
    --policy pick=0 --policy pick=1 --policy pick=2 --policy pick=3 --policy heads_fast=false
  [ -e .probe/kernels_of.py ] && T=90 X python3 .probe/kernels_of.py --batch-size 8 --heads 1 --seq-len 8192 --d-head 64 > "$OUT/short_kernels.txt"
  cat "$OUT/short_kernels.txt" 2>/dev/null
fi
if part byo; then
  A=tests/fixtures/byo/cs336_layout/tests
  T=150 run byo.md flash check --device cuda --adapters $A/adapters.py
  T=60 run byo.md flash check --device cuda --adapters $A/adapters_missing_scale.py --impl yours-torch --tier contract
fi
if part host; then
  HOST="bench attention --device cuda --dtype bf16 --batch-size 8 --heads 1 --d-head 16,64,128 --warmup 10 --steps 30"
  for c in --causal --no-causal; do
    T=150 run host.md $HOST $c --context-length 256,1024,2048,4096 --impl flash-triton,sdpa-cudnn,sdpa-flash \
      --policy host_bound_flops=0 --policy host_bound_flops=34359738368
  done
  T=90 run host.md $BOARD --impl flash-triton,sdpa-cudnn,sdpa-flash
fi
if part host || part hostprof; then
  # µs a warm fwd+bwd at 8 x 1 x 256 d 64 takes the host, causal and not: each variant 200 calls back to back, 4
  # rounds interleaved (median [min-max]); an empty autograd.Function with the same allocations is the floor
  T=120 X python3 -c "$(printf '%s\n' 'import cProfile, pstats, statistics as st, sys, time, torch; from dataclasses import replace' \
    'from lmsys.kernels import flash, plans; from torch.nn.attention import sdpa_kernel, SDPBackend as B; F = torch.nn.functional.scaled_dot_product_attention' \
    'class E(torch.autograd.Function):' '  forward = staticmethod(lambda ctx, q, k, v: (ctx.save_for_backward(q), torch.empty_like(q))[1])' \
    '  backward = staticmethod(lambda ctx, do: tuple(torch.empty_like(do) for _ in range(3)))' \
    'P, A = flash.DEFAULT_POLICY, lambda pol: lambda q, k, v, c: flash.FlashAttentionTriton.apply(q, k, v, c, None, pol)' \
    'def S(b):' '  def f(q, k, v, c):' '    with sdpa_kernel(b): return F(q, k, v, is_causal=c)' '  return f' \
    'V = {"flash-triton": A(P), "fused_backward=False": A(replace(P, fused_backward=False)), "host_bound_flops=0": A(replace(P, host_bound_flops=0)),' \
    '     "sdpa": lambda q, k, v, c: F(q, k, v, is_causal=c), "sdpa cudnn": S(B.CUDNN_ATTENTION), "sdpa flash": S(B.FLASH_ATTENTION), "empty Function": lambda q, k, v, c: E.apply(q, k, v)}' \
    'for c in (True, False):' '  q, k, v = (torch.randn(8, 1, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)); do = torch.randn_like(q); R = {n: [] for n in V}' \
    '  for r in range(5):' '    for n, f in V.items():' '      torch.cuda.synchronize(); t = time.perf_counter(); [torch.autograd.grad(f(q, k, v, c), (q, k, v), do) for _ in range(200)]' \
    '      R[n].append((time.perf_counter() - t) / 200 * 1e6) if r else None' \
    '  print(f"causal={c}:", "; ".join(f"{n} {st.median(x):.1f} [{min(x):.1f}-{max(x):.1f}] us" for n, x in R.items()))' \
    '  plans.STATS.update(hits=0, misses=0, normal=0); p = cProfile.Profile(); p.enable(); [torch.autograd.grad(V["flash-triton"](q, k, v, c), (q, k, v), do) for _ in range(200)]; p.disable()' \
    '  print("plans", dict(plans.STATS)); pstats.Stats(p, stream=sys.stdout).sort_stats(pstats.SortKey.TIME).print_stats(14)')" >> "$OUT/host_profile.txt"
fi
echo "== done in $(elapsed)s"
} 2>&1 | tee -a "$OUT/attention.log"

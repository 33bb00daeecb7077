#!/usr/bin/env bash
# How long attention's first call takes (issue 26 item 8), kind nvidia-h200, from the repository root:
# `bash scripts/gpu/first_call.sh`. PARTS picks the steps (default "probe leaderboard"):
#   probe        for each impl of IMPLS and head dim of DS, two fresh processes: the first with empty Triton
#                and lmsys cache dirs ("cold"), the second with what the first left there ("warm disk"). Each
#                times the import of the impl's module, then the first fwd+bwd (causal, b1, HEADS heads,
#                torch.cuda.synchronize before and after) at each length of SEQS in turn: after the first,
#                each is a new length in a warm process -> $OUT/first_call.md
#                IMPLS: sdpa, flash-triton (the default policy: on an H200 the Gluon kernels at 4096, the
#                tl ones at 4100 and 4200), flash-triton-tl (the same with gluon=false: tl kernels only),
#                flash-triton-tl-serial (the same, the tuner's candidates compiled one by one:
#                LMSYS_TUNE_COMPILE_THREADS=0), flash-triton-noprecompile (the default policy without the
#                backward's kernels compiled in the background from the first forward, nor Triton's driver
#                built beside its hash: LMSYS_PRECOMPILE_BACKWARD=0). Before any timing a process runs an unrelated matmul
#                forward and backward (WARMUP=1, the default): the CUDA context, cuBLAS, autograd's first run
#                and the modules a backward with a gradient imports are then paid by every impl alike, outside
#                the timings
#   profile      cProfile of the warm-disk process's first call (PROFILE_PROCESS=cold: the cold one's; sdpa
#                and flash-triton, d 64, the first of SEQS) -> $OUT/profile-IMPL.pstats and the top 40 by
#                cumulative time in profile-IMPL.txt
#   leaderboard  bench attention --preset leaderboard at d 64, 128 and 80, beside cuDNN, the default policy
#                and the tl kernels: the tuner's picks must not make a kernel slower -> $OUT/leaderboard.md
# On a CPU: TRITON_INTERPRET=1 DEVICE=cpu DTYPE=float32 DS=16 HEADS=2 SEQS="40 45" PARTS=probe (the tests do).
# Time-guarded (scripts/gpu/lib.sh; BUDGET default 560 s; DRY_RUN=1 prints the commands); log: first_call.log.
set -u
BUDGET=${BUDGET:-560}; source scripts/gpu/lib.sh
PARTS=${PARTS:-probe leaderboard}
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} HEADS=${HEADS:-16} DS=${DS:-64 128} SEQS=${SEQS:-4096 4100 4200}
IMPLS=${IMPLS:-sdpa flash-triton flash-triton-tl flash-triton-tl-serial} WARMUP=${WARMUP:-1}
# argv: impl d dtype device heads process warmup seqs...; prints one Markdown row of seconds
PROBE='
import sys, time
impl, d, dtype, device, heads, process, warmup, *seqs = sys.argv[1:]
label, impl = impl, impl.removesuffix("-serial").removesuffix("-noprecompile")
import torch
torch.empty(1, device=device)  # the CUDA context: not part of any timing
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
if warmup == "1":  # what any first fwd+bwd pays whatever its kernels: cuBLAS, autograd, the allocator, and
    # the modules a backward with a given gradient imports the first time (torch.fx symbolic shapes, sympy:
    # 3.3 s on the H200 image, which compiles them from source in every process)
    a = torch.randn(256, 256, device=device, dtype=getattr(torch, dtype), requires_grad=True)
    (a @ a).backward(torch.ones(256, 256, device=device, dtype=a.dtype))
    sync()
start = time.perf_counter()
if impl.startswith("flash-triton"):
    from dataclasses import replace
    from lmsys.kernels import flash_triton as ft
    policy = ft.default_policy() if impl == "flash-triton" else replace(ft.default_policy(), gluon=False)
    def run(q, k, v):
        return ft.FlashAttentionTriton.apply(q, k, v, True, None, policy)
else:
    import torch.nn.functional as F
    def run(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
cells = [label, d, process, f"{time.perf_counter() - start:.2f}"]
for n in seqs:
    q, k, v, do = (torch.randn(1, int(heads), int(n), int(d), device=device, dtype=getattr(torch, dtype))
                   for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    sync()
    start = time.perf_counter()
    run(q, k, v).backward(do)
    sync()
    cells.append(f"{time.perf_counter() - start:.2f}")
print("| " + " | ".join(cells) + " |")
'
BOARD="bench attention --device cuda --preset leaderboard --warmup 5 --steps 30"
run() {  # run FILE lmsys-args: the table under its command in $OUT/FILE (nothing written when skipped)
  local file=$1; shift
  if have_time; then { md "$@"; L "$@" -f md; } >> "$OUT/$file"; else L "$@"; fi
}
{
date -u; [ "$DEVICE" = cuda ] && env_line; echo "parts: $PARTS, budget ${BUDGET}s"
if part probe; then
  CACHES=$(mktemp -d); echo "$PROBE" > "$CACHES/probe.py"
  {
    printf '| impl | d | process | import s |'; for n in $SEQS; do printf ' first fwd+bwd s, seq %s |' "$n"; done
    printf '\n|---|---|---|---|'; for n in $SEQS; do printf -- '---|'; done; echo
  } > "$OUT/first_call.md"
  for impl in $IMPLS; do
    for d in $DS; do
      threads=1; [ "${impl%-serial}" != "$impl" ] && threads=0
      pre=1; [ "${impl%-noprecompile}" != "$impl" ] && pre=0
      for process in cold "warm disk"; do  # the second process finds what the first left in these dirs
        TRITON_CACHE_DIR="$CACHES/$impl-$d/triton" LMSYS_CACHE_DIR="$CACHES/$impl-$d/lmsys" T=150 \
          LMSYS_TUNE_COMPILE_THREADS=$threads LMSYS_PRECOMPILE_BACKWARD=$pre X python3 "$CACHES/probe.py" "$impl" "$d" "$DTYPE" "$DEVICE" \
          "$HEADS" "$process" "$WARMUP" $SEQS >> "$OUT/first_call.md"
      done
    done
  done
  rm -rf "$CACHES"
  cat "$OUT/first_call.md"
fi
if part profile; then  # where a fresh process's first call goes: cProfile of the warm-disk process, d 64
  CACHES=$(mktemp -d); echo "$PROBE" > "$CACHES/probe.py"
  for impl in ${PROFILE_IMPLS:-sdpa flash-triton}; do
    for process in cold "warm disk"; do
      prof=(); [ "$process" = "${PROFILE_PROCESS:-warm disk}" ] && prof=(-m cProfile -o "$OUT/profile-$impl.pstats")
      pre=1; [ "${impl%-noprecompile}" != "$impl" ] && pre=0
      TRITON_CACHE_DIR="$CACHES/$impl/triton" LMSYS_CACHE_DIR="$CACHES/$impl/lmsys" LMSYS_PRECOMPILE_BACKWARD=$pre T=150 X python3 \
        "${prof[@]}" "$CACHES/probe.py" "$impl" 64 "$DTYPE" "$DEVICE" "$HEADS" "$process" "$WARMUP" ${SEQS%% *}
    done
    [ -n "${DRY_RUN:-}" ] || python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumtime').print_stats(40)" \
      "$OUT/profile-$impl.pstats" > "$OUT/profile-$impl.txt" 2>&1
  done
  rm -rf "$CACHES"
fi
if part leaderboard; then
  for d in 64 128 80; do
    T=150 run leaderboard.md $BOARD --impl sdpa-cudnn,flash-triton --d-head $d --policy gluon=false,deterministic=true
  done
fi
echo "== done in $(elapsed)s"
} 2>&1 | tee -a "$OUT/first_call.log"

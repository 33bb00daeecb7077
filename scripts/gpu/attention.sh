#!/usr/bin/env bash
# FlashAttention-2 on one GPU: the kernels' GPU tests, `lmsys flash check` on cuda, and the attention
# benchmarks cited in issue 3 (leaderboard shape against SDPA's backends, causal d128 forward, seq 65536,
# the seed's sweep in fp32 and bf16). Logs under $OUT (default ./lmsys-out): pytest.log, check.md,
# results.md (every benchmark table with its command), bench.log, summary.txt (printed as it goes).
#
#   scripts/gpu/attention.sh [STAGE...]
#
# stages (default: tests check leaderboard configs long seed):
#   tests        pytest tests/test_flash_triton.py tests/test_flash_torch.py (gpu-marked ones included)
#   check        lmsys flash check on cuda (flash-triton, then flash-torch)
#   leaderboard  bf16 causal b1 h16 s16384, d 64 and d 128: naive / SDPA's flash and cuDNN backends / ours
#   configs      every config the autotuner timed on those shapes; `explore`: a wider list, compiled in parallel
#   long         seq 16384, 32768, 65536 (d 64, b1 h16, bf16 causal): time and peak memory
#   seed         the seed's sweep (b8 h1, d 16..128, seq 256..16384), fp32 and bf16, naive/compiled/flash-triton
#                (`seed-baselines` and `seed-flash` run the first two and the last implementation alone)
#   warm         compile every shipped config the benchmarks will autotune, 8 processes at a time, alongside
#                the tests (Triton's cache then serves the timing runs)
#
# Run from the repository root; the package is taken from src/ (no install needed).
set -uo pipefail
OUT=${OUT:-lmsys-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${*:-tests check leaderboard configs long seed}
LMSYS="python3 -m lmsys"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null)"
say "== $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"

if has warm; then  # in the background, next to the tests; the benchmarks start after both
  t_warm=$SECONDS
  for i in 0 1 2 3 4 5 6 7; do
    { python3 scripts/gpu/attention_configs.py --compile-slice $i/8 --heads 1 --dtype fp32,bf16 --d-head 16,32,64,128 \
          --seq-len 256 --causal no
      python3 scripts/gpu/attention_configs.py --compile-slice $i/8 --dtype bf16 --d-head 64,128 --seq-len 256 \
          --causal yes; } >/tmp/warm.$i.log 2>&1 &
  done
fi

if has tests; then
  # Correctness first; one config per kernel unless a test picks configs itself (compile time).
  t0=$SECONDS
  LMSYS_FLASH_AUTOTUNE=0 python3 -m pytest -q -n 8 -p no:cacheprovider \
      tests/test_flash_triton.py tests/test_flash_torch.py >"$OUT/pytest.log" 2>&1
  say "tests: rc=$? in $((SECONDS - t0)) s: $(tail -n 1 "$OUT/pytest.log")"
fi

if has warm; then
  wait
  say "warm: $((SECONDS - t_warm)) s, $(cat /tmp/warm.*.log | grep -c Error) configs out of resources"
fi

if has check; then
  t0=$SECONDS
  $LMSYS flash check --device cuda --cases 24 --seed 0 -f md >"$OUT/check.md" 2>&1
  say "flash check flash-triton: rc=$? in $((SECONDS - t0)) s: $(tail -n 1 "$OUT/check.md")"
  $LMSYS flash check --device cuda --impl flash-torch --cases 6 --seed 1 -f md >>"$OUT/check.md" 2>&1
  say "flash check flash-torch: rc=$?: $(tail -n 1 "$OUT/check.md")"
fi

short_table() {  # the main columns of a markdown table, for the summary
  python3 -c '
import sys
lines = [l for l in open(sys.argv[1]) if l.startswith("|")]
keep = ["impl", "batch", "heads", "d", "seq", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
        "peak bwd MiB", "status"]
if lines:
    head = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    idx = [head.index(k) for k in keep if k in head]
    for line in [lines[0]] + lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        print("  " + " | ".join(cells[i] if i < len(cells) else "" for i in idx))
' "$1"
}

bench() {  # name, then options of `lmsys bench attention`; tables to results.md, logs to bench.log
  local name=$1
  shift
  local t0=$SECONDS
  echo "=== bench $name: $*" >>"$OUT/bench.log"
  TRITON_PRINT_AUTOTUNING=1 $LMSYS bench attention --device cuda -f md -o "/tmp/$name.md" "$@" \
      >>"$OUT/bench.log" 2>&1
  say "bench $name: rc=$? in $((SECONDS - t0)) s"
  short_table "/tmp/$name.md" | tee -a "$SUMMARY"
  { echo "<!-- lmsys bench attention --device cuda $* -->"; cat "/tmp/$name.md"; echo; } >>"$OUT/results.md"
}

if has leaderboard; then
  bench leaderboard --preset leaderboard --impl naive,sdpa-flash,sdpa-cudnn,flash-triton
  bench causal-d128 --preset leaderboard --d-head 128 --impl sdpa-flash,sdpa-cudnn,flash-triton
fi

if has explore; then
  t0=$SECONDS
  for i in 0 1 2 3 4 5 6 7; do
    python3 scripts/gpu/attention_configs.py --explore --compile-slice $i/8 >/tmp/compile.$i.log 2>&1 &
  done
  wait
  say "explore: compiled in $((SECONDS - t0)) s: $(cat /tmp/compile.*.log | grep -c Error) configs out of resources"
  python3 scripts/gpu/attention_configs.py --explore >/tmp/configs.log 2>&1
  say "explore: rc=$? in $((SECONDS - t0)) s"
  cat /tmp/configs.log >>"$SUMMARY"
  cat /tmp/configs.log
fi

if has configs; then
  python3 scripts/gpu/attention_configs.py >/tmp/configs.log 2>&1
  say "configs: rc=$?"
  cat /tmp/configs.log >>"$SUMMARY"
  grep -E "==|\*" /tmp/configs.log
fi

if has long; then
  bench long --preset leaderboard --impl flash-triton --seq-len 16384,32768,65536 --warmup 2 --steps 10
fi

if has seed; then
  bench seed-fp32 --impl naive,compiled,flash-triton --dtype fp32
  bench seed-bf16 --impl naive,compiled,flash-triton --dtype bf16
fi
if has seed-baselines; then
  bench seed-baselines-fp32 --impl naive,compiled --dtype fp32
  bench seed-baselines-bf16 --impl naive,compiled --dtype bf16
fi
if has seed-flash; then
  bench seed-flash-fp32 --impl flash-triton --dtype fp32
  bench seed-flash-bf16 --impl flash-triton --dtype bf16
fi

# Triton's compiled kernels, so that a later call can start warm (TRITON_CACHE_DIR); only if small.
tar czf /tmp/triton-cache.tgz -C "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" . 2>/dev/null &&
  [ "$(stat -c %s /tmp/triton-cache.tgz)" -lt 15000000 ] && cp /tmp/triton-cache.tgz "$OUT/"
say "== done $(date -u +%FT%TZ)"

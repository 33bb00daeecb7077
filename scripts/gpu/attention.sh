#!/usr/bin/env bash
# FlashAttention-2 on one GPU: the kernels' GPU tests, `lmsys flash check` on cuda, and the attention
# benchmarks cited in issue 3 (leaderboard shape against SDPA's backends, causal d128 forward, seq 65536,
# the seed's sweep in fp32 and bf16). Full logs under $OUT (default ./lmsys-out), a short summary last.
#
#   scripts/gpu/attention.sh [STAGE...]     stages: tests check leaderboard long seed (default: all)
#
# Run from the repository root; the package is taken from src/ (no install needed).
set -uo pipefail
OUT=${OUT:-lmsys-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STAGES=${*:-tests check leaderboard long seed}
LMSYS="python3 -m lmsys"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null)"
say "== $(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"

if has tests; then
  # Correctness first; one config per kernel unless a test picks configs itself (compile time).
  t0=$SECONDS
  LMSYS_FLASH_AUTOTUNE=0 python3 -m pytest -q -n 8 tests/test_flash_triton.py tests/test_flash_torch.py \
      -p no:cacheprovider >"$OUT/pytest.log" 2>&1
  say "tests: rc=$? in $((SECONDS - t0)) s: $(tail -n 1 "$OUT/pytest.log")"
fi

if has check; then
  t0=$SECONDS
  LMSYS_FLASH_AUTOTUNE=0 $LMSYS flash check --device cuda --cases 15 --seed 0 -f md >"$OUT/check.md" 2>&1
  say "flash check flash-triton: rc=$? in $((SECONDS - t0)) s: $(tail -n 1 "$OUT/check.md")"
  $LMSYS flash check --device cuda --impl flash-torch --cases 6 --seed 1 -f md >>"$OUT/check.md" 2>&1
  say "flash check flash-torch: rc=$?: $(tail -n 1 "$OUT/check.md")"
fi

bench() {  # name, then options of `lmsys bench attention`
  local name=$1
  shift
  local t0=$SECONDS
  TRITON_PRINT_AUTOTUNING=1 $LMSYS bench attention --device cuda -f md -o "$OUT/$name.md" "$@" \
      >"$OUT/$name.log" 2>&1
  say "bench $name: rc=$? in $((SECONDS - t0)) s"
  python3 - "$OUT/$name.md" <<'EOF' | tee -a "$SUMMARY"
import sys
lines = [l for l in open(sys.argv[1]) if l.startswith("|")]
keep = ["impl", "batch", "heads", "d", "seq", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
        "peak bwd MiB", "status"]
if lines:
    head = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    idx = [head.index(k) for k in keep if k in head]
    for line in [lines[0]] + lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        print("  " + " | ".join(cells[i] for i in idx))
EOF
}

if has leaderboard; then
  bench leaderboard --preset leaderboard --impl naive,sdpa-flash,sdpa-cudnn,flash-triton
  bench causal-d128 --preset leaderboard --d-head 128 --impl sdpa-flash,sdpa-cudnn,flash-triton
fi

if has long; then
  bench long --preset leaderboard --impl flash-triton --seq-len 16384,32768,65536 --warmup 2 --steps 10
fi

if has seed; then
  bench seed-fp32 --impl naive,compiled,flash-triton --dtype fp32
  bench seed-bf16 --impl naive,compiled,flash-triton --dtype bf16
fi

# Triton's compiled kernels, so that a later call can start warm (TRITON_CACHE_DIR).
tar czf "$OUT/triton-cache.tgz" -C "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" . 2>/dev/null
say "== done $(date -u +%FT%TZ)"

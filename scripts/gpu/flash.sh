#!/usr/bin/env bash
# flash-triton speed levers and the official comparison on one GPU (issue 12), in about 8 minutes:
#   1. scripts/gpu/flash_levers.py: each lever alone and the best combination, d 64 and d 128, plus d 80
#      and GQA (Hkv 4) against SDPA  -> $OUT/levers.md
#   2. lmsys bench attention --preset leaderboard (d 64, then --d-head 128) -> $OUT/leaderboard*.md
#   3. lmsys flash check on cuda (padded head dims and GQA cases included) -> $OUT/check.md
#   0. with TESTS=1, first: the flash-triton tests on the GPU (gpu-marked, descriptors, atomic backward;
#      ~450 s with a cold Triton cache) -> $OUT/pytest.txt, and nothing else in that call
# LEVERS=persistent,wide picks the lever rows of step 1 (default: all); CASES the flash check's cases
# (default 24, ~230 s: all of it takes more than one 600 s device call, so split it with these two).
# Run from the repository root; the package is taken from src/.
set -uo pipefail
OUT=${OUT:-lmsys-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LMSYS="python3 -m lmsys"
t0=$SECONDS
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)" | tee "$OUT/summary.txt"
if [ "${TESTS:-0}" = 1 ]; then
    timeout 560 python3 -m pytest -q -p no:cacheprovider -k "gpu or descriptors or atomic" tests/test_flash_triton.py \
        >"$OUT/pytest.txt" 2>&1
    echo "tests: rc=$? at $((SECONDS - t0)) s: $(tail -n 1 "$OUT/pytest.txt")" | tee -a "$OUT/summary.txt"
    exit 0
fi
timeout 330 python3 scripts/gpu/flash_levers.py --out "$OUT/levers.md" ${LEVERS:+--levers "$LEVERS"} 2>&1 | tee "$OUT/levers.log"
echo "levers: rc=${PIPESTATUS[0]} at $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
timeout 90 $LMSYS bench attention --device cuda --preset leaderboard --impl sdpa-flash,sdpa-cudnn,flash-triton \
    --warmup 5 --steps 30 -f md >"$OUT/leaderboard.md" 2>&1
echo "leaderboard d64: rc=$? at $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
timeout 60 $LMSYS bench attention --device cuda --preset leaderboard --impl sdpa-flash,sdpa-cudnn,flash-triton \
    --d-head 128 --warmup 5 --steps 30 -f md >"$OUT/leaderboard128.md" 2>&1
echo "leaderboard d128: rc=$? at $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
timeout 250 $LMSYS flash check --device cuda --cases ${CASES:-24} --seed 0 -f md >"$OUT/check.md" 2>&1
echo "flash check: rc=$? at $((SECONDS - t0)) s: $(tail -n 1 "$OUT/check.md")" | tee -a "$OUT/summary.txt"

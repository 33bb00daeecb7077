#!/usr/bin/env bash
# Issues 2 and 7 on one H200 (kind nvidia-h200, or one lane of scripts/gpu/x2_lanes.sh), from the repo
# root: `bash scripts/gpu/e2e.sh`. PARTS picks the steps (default: all); they run in this order:
#   compare   2.7b bf16 and small fp32: --fast next to plain eager / plain compiled (--compare)
#   16k       large at context 16384: the fast path (SDPA; flash-triton) with and without checkpointing
#   baseline  --mode all over small..2.7b, fp32 and bf16, and --warmup 0/1/2/5 on small
#   ablation  2.7b bf16: what each fast-path switch gives, one at a time
# Every command is time-guarded (scripts/gpu/lib.sh; BUDGET default 540 s). $OUT gets e2e.log and one
# Markdown file per part, each table under the command that printed it.
set -u
BUDGET=${BUDGET:-540}; source scripts/gpu/lib.sh
PARTS=${PARTS:-compare 16k baseline ablation}
run() {  # run FILE lmsys-args: the table under its command in $OUT/FILE (nothing written when skipped)
  local file=$1; shift
  if have_time; then { md "$@"; L "$@" -f md; } >> "$OUT/$file"; else L "$@"; fi
}
{
date -u; env_line; echo "parts: $PARTS, budget ${BUDGET}s"
if part compare; then
  T=260 run e2e_compare.md bench e2e --size 2.7b --dtype bf16 --fast --compare --warmup 3 --steps 10
  T=120 run e2e_compare.md bench e2e --size small --dtype fp32 --fast --compare --warmup 3 --steps 10
fi
if part 16k; then
  T=150 run e2e_16k.md bench e2e --size large --context-length 16384 --dtype bf16 --fast --checkpoint none,block --warmup 1 --steps 3
  T=100 run e2e_16k.md bench e2e --size large --context-length 16384 --dtype bf16 --fast --attn flash-triton --warmup 1 --steps 3
fi
if part baseline; then
  for dt in fp32 bf16; do
    T=110 run e2e_baseline.md bench e2e --size small,medium,large,xl,2.7b --mode all --dtype $dt --warmup 2 --steps 5
  done
  for w in 0 1 2 5; do T=30 run e2e_warmup.md bench e2e --size small --warmup $w --steps 10; done
fi
if part ablation; then
  for flags in "--optimizer adamw" "--optimizer adamw-fused" "--master-weights" "--master-weights --attn sdpa" \
               "--master-weights --attn sdpa --compile" "--master-weights --attn sdpa --compile --cuda-graphs"; do
    T=120 run e2e_ablation.md bench e2e --size 2.7b --dtype bf16 $flags --warmup 3 --steps 10
  done
fi
echo "== done in $(elapsed)s"
} 2>&1 | tee -a "$OUT/e2e.log"

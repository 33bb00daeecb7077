#!/usr/bin/env bash
# Issue 15 (and the e2e tables of issues 2 and 7) on one H200 (kind nvidia-h200, or one lane of
# scripts/gpu/x2_lanes.sh), from the repo root: `bash scripts/gpu/e2e.sh`. PARTS picks the steps
# (default: all, ~8 minutes); they run in this order, the target first:
#   compare   2.7b bf16: --fast next to plain eager / plain compiled (--compare): ≤ 86 ms, ≥ 50 % MFU, ≥ 1.35×
#   ablation  2.7b bf16: the fast path one switch at a time (optimizer in backward off/on, side stream
#             off/on, per-block against whole-model compile)
#   others    small fp32 (TF32) and xl bf16, each --fast against plain compiled (--compare)
#   carve     2.7b bf16: the in-backward updates on a side stream, without a carveout and with the
#             matmuls leaving 16/32/48/8 SMs to them (--sm-carveout), after --fast (optimizer after the
#             backward), one process per row
#   16k       large at context 16384: the fast path (SDPA; flash-triton) with and without checkpointing
#   baseline  --mode all over small..2.7b, fp32 and bf16, and --warmup 0/1/2/5 on small
#   flash     the --fast decision (issue 26 item 4): --fast with sdpa, then with flash-triton (a custom op
#             that torch.compile traces), each without and with CUDA graphs, at xl (d 64), 2.7b with 20
#             heads (d 128) and large with 10 heads (d 128) at context 4096; first bench attention at
#             xl's attention shape (the per-call cost)
#   byo       issue 41: --fast on the cs336_basics-style model at xl (its own time to the table), then --compare
#             (the user model compiled whole as `plain compiled` takes ~135 s alone: give it ~450 s;
#             BYO_COMPARE=0 leaves --compare out)
# 16k and baseline are the issue 2/7 tables; run them with PARTS="16k baseline" when needed.
# Every command is time-guarded (scripts/gpu/lib.sh; BUDGET default 480 s; DRY_RUN=1 prints them). $OUT
# gets e2e.log and one Markdown file per part, each table under the command that printed it.
set -u
BUDGET=${BUDGET:-480}; source scripts/gpu/lib.sh
PARTS=${PARTS:-compare ablation others}
run() {  # run FILE lmsys-args: the table under its command in $OUT/FILE (nothing written when skipped)
  local file=$1; shift
  if have_time; then { md "$@"; L "$@" -f md; } >> "$OUT/$file"; else L "$@"; fi
}
{
date -u; env_line; echo "parts: $PARTS, budget ${BUDGET}s"
if part compare; then
  T=200 run e2e_compare.md bench e2e --size 2.7b --dtype bf16 --fast --compare --warmup 3 --steps 10
fi
if part ablation; then
  # 1: issue 7's fast path (whole-model compile, optimizer after backward); 2: per-block compile alone;
  # 3: + optimizer in backward on the backward's stream; 4: + side stream (= --fast). `--fast --compile`
  # (in backward under whole-model compile, which hands over the gradients only at the end) is left out
  # for time: run it alone when 1 and 2 are close.
  for flags in "--no-optimizer-in-backward --compile" "--no-optimizer-in-backward" "--no-optimizer-stream" ""; do
    T=75 run e2e_ablation.md bench e2e --size 2.7b --dtype bf16 --fast $flags --warmup 3 --steps 10
  done
fi
if part carve; then
  IB="--compile-blocks --optimizer-in-backward --optimizer-stream"
  for flags in "" "$IB" "$IB --sm-carveout 16" "$IB --sm-carveout 32" "$IB --sm-carveout 48" "$IB --sm-carveout 8"; do
    T=80 run e2e_carve.md bench e2e --size 2.7b --dtype bf16 --fast $flags --warmup 3 --steps 10
  done
fi
if part others; then
  T=70 run e2e_others.md bench e2e --size small --dtype fp32 --fast --compare --warmup 3 --steps 10
  T=110 run e2e_others.md bench e2e --size xl --dtype bf16 --fast --compare --warmup 3 --steps 10
fi
if part 16k; then
  T=150 run e2e_16k.md bench e2e --size large --context-length 16384 --dtype bf16 --fast --checkpoint none,block --warmup 1 --steps 3
  T=100 run e2e_16k.md bench e2e --size large --context-length 16384 --dtype bf16 --fast --attn flash-triton --warmup 1 --steps 3
fi
if part flash; then
  # the per-call cost at the model's attention shape (xl: b4 h25 s512 d64), kernel and host together
  T=60 run e2e_flash.md bench attention --device cuda --impl sdpa-cudnn,sdpa-flash,flash-triton --batch-size 4 \
    --heads 25 --d-head 64 --context-length 512 --dtype bf16 --causal --warmup 10 --steps 100
  for shape in "--size xl" "--size 2.7b --heads 20" "--size large --heads 10 --context-length 4096 --batch-size 2"; do
    for graphs in "" "--cuda-graphs"; do
      for impl in sdpa flash-triton; do
        T=${FLASH_T:-100} run e2e_flash.md bench e2e $shape --dtype bf16 --fast $graphs --attn $impl --warmup 3 --steps 10
      done
    done
  done
fi
if part byo; then
  CS336="bench e2e --fast --model cs336_basics.model:BasicsTransformerLM --size xl --dtype bf16"
  s=$(date +%s); PYTHONPATH=tests/fixtures/byo/pkgs:$PYTHONPATH T=240 run e2e_byo.md $CS336
  echo "($(( $(date +%s) - s )) s from the command to its table)" >> "$OUT/e2e_byo.md"
  [ "${BYO_COMPARE:-1}" = 1 ] && PYTHONPATH=tests/fixtures/byo/pkgs:$PYTHONPATH T=${BYO_T:-450} run e2e_byo.md $CS336 --compare --warmup 2 --steps 5
fi
if part baseline; then
  for dt in fp32 bf16; do
    T=110 run e2e_baseline.md bench e2e --size small,medium,large,xl,2.7b --mode all --dtype $dt --warmup 2 --steps 5
  done
  for w in 0 1 2 5; do T=30 run e2e_warmup.md bench e2e --size small --warmup $w --steps 10; done
fi
echo "== done in $(elapsed)s"
} 2>&1 | tee -a "$OUT/e2e.log"

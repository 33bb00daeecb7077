#!/usr/bin/env bash
# Issues 29, 30 and 31 on the GPU (kind nvidia-h200 for the one-GPU parts, -x2 / -x4 for the others), from
# the repository root: `PARTS="..." bash scripts/gpu/parallel.sh`. Parts, in this order:
#   degenerate  one GPU: parallel train on the mesh dp=1,tp=1,pp=1 (xl bf16, batch 4 x 512, --fast off): its
#               `1 process` row is bench e2e's step in the same process, `× 1 process` the ratio (issue 29:
#               within 5 %); REPS=N repeats it (default 3: medians, the host-bound step moves by ±10 %)
#   degenerate-nsys  the same pair under nsys (kernel and CUDA API summaries as CSV: what differs)
#   plan        one GPU: plan calibrate (the matmul shapes of xl and of PLAN_SIZES, fp32 and bf16; the host twin
#               at xl's width), then PLAN_REPS (default 2) runs of plan validate over small..2.7b (PLAN_SIZES),
#               fp32 and bf16, with and without checkpointing, 10 timed steps a row (issue 30: within 10 %), at
#               PLAN_BATCH sequences (default 4, bench e2e's default; calibrated at it too); PLAN_MESH=none
#               leaves the parallel train rows out; PLAN_REPEATS=N runs each row N times between host twins
#               (default 1; the host-bound rows move by ±15 % from run to run)
#   sustain     one GPU: plan calibrate --sustain SUSTAIN (default 10 s) at published runs' GEMM shapes (Llama 2 7B,
#               13B at 4,096 tokens, GPT-3 175B; bf16, batch SUSTAIN_BATCH=2): rates kept back to back (issue 42)
#   reproduce   one GPU: does a host-bound row repeat? REPRO_RUNS (default 6) times a pure-Python loop (the CPU's
#               speed) and plan validate of medium, large, xl bf16 --repeats 3 on the committed H200 profile (issue 30)
#   breakdown   one GPU: plan breakdown over BREAKDOWN_SIZES (default xl,2.7b), bf16 and fp32 (with the plan
#               part's profile when it ran first, else calibrating its sizes itself)
#   w2          2 GPUs: tp=2, tp=2 + SP, pp=2 gpipe and 1f1b (8 microbatches), lmsys beside torch (issue 31)
#   w4          4 GPUs: dp=2,tp=2 (bucketed, fsdp), pp=2,tp=2, pp=4 interleaved-1f1b (issue 31)
#   sendrecv    comm send-recv 1 KB..1 GB on every GPU present, with the bare loop (issue 31)
# Every command is time-guarded (scripts/gpu/lib.sh, BUDGET default 560 s; DRY_RUN=1 prints them); each
# table goes to $OUT/<part>.md under the command that printed it.
set -u
BUDGET=${BUDGET:-560}; source scripts/gpu/lib.sh
PARTS=${PARTS:-degenerate plan}
XL="--size xl --dtype bf16 --batch-size 4 --context-length 512 --warmup 3 --steps 10"
run() {  # run FILE lmsys-args: the table under its command in $OUT/FILE (nothing written when skipped)
  local file=$1; shift
  if have_time; then { md "$@"; L "$@" -f md; } >> "$OUT/$file"; else L "$@"; fi
}
{
date -u; env_line; echo "parts: $PARTS, budget ${BUDGET}s"
if part degenerate; then
  for i in $(seq "${REPS:-3}"); do
    T=150 run degenerate.md parallel train --mesh dp=1,tp=1,pp=1 --microbatches 1 --world-size 1 --backend nccl $XL
  done
fi
if part degenerate-nsys; then  # the same pair under nsys: kernels (with instance counts) and CUDA API calls
  NSYS=${NSYS:-$(ls /opt/nvidia/nsight-*/*/host/target-linux-x64/nsys 2>/dev/null | head -1)}
  for what in "parallel train --mesh dp=1,tp=1,pp=1 --microbatches 1 --world-size 1 --backend nccl" "bench e2e --device cuda"; do
    name=${what%% *}
    T=150 X "$NSYS" profile -t cuda,nvtx -f true -o "$OUT/$name" python3 -m lmsys $what $XL -f md
    T=90 X "$NSYS" stats --report cuda_gpu_kern_sum --report cuda_api_sum --format csv --force-export true \
      -o "$OUT/$name" "$OUT/$name.nsys-rep" > /dev/null
    rm -f "$OUT/$name.nsys-rep" "$OUT/$name.sqlite"
  done
fi
if part plan; then
  SIZES=${PLAN_SIZES:-small,medium,large,xl,2.7b}
  B=${PLAN_BATCH:-4}
  T=180 X python3 -m lmsys plan calibrate --size "${CAL_SIZES:-xl,small,medium,large,2.7b}" --dtype fp32,bf16 \
    --batch-size "$B" --profile "$OUT/gpu.yaml" -f md >> "$OUT/plan.md"
  for i in $(seq "${PLAN_REPS:-2}"); do
    T=$((300 * ${PLAN_REPEATS:-1})) run plan.md plan validate --profile "$OUT/gpu.yaml" --size "$SIZES" --batch-size "$B" \
      ${PLAN_MESH:+--mesh "$PLAN_MESH"} --repeats "${PLAN_REPEATS:-1}" --warmup 2 --steps 10
  done
fi
if part sustain; then
  T=240 X python3 -m lmsys plan calibrate --size scripts/gpu/llama2-7b.yaml,scripts/gpu/llama2-13b.yaml,gpt-175b --dtype bf16 --batch-size "${SUSTAIN_BATCH:-2}" --sustain "${SUSTAIN:-10}" --profile "$OUT/sustain.yaml" -f md >> "$OUT/sustain.md"
fi
if part reproduce; then
  LOOP='import time, statistics as s
t = []
for _ in range(15):
    a = time.perf_counter(); sum(i * i for i in range(100000)); t.append((time.perf_counter() - a) * 1e3)
print(f"python loop ms: median {s.median(t):.2f}, min {min(t):.2f}, max {max(t):.2f}")'
  for i in $(seq "${REPRO_RUNS:-6}"); do
    T=30 X python3 -c "$LOOP" >> "$OUT/reproduce.md"
    T=100 run reproduce.md plan validate --profile docs/benchmarks/plan-h200-profile.yaml --size medium,large,xl \
      --dtype bf16 --checkpoint none --mesh none --batch-size 4 --warmup 2 --steps 10 --repeats 3
  done
fi
if part breakdown; then
  PROFILE=(); [ -f "$OUT/gpu.yaml" ] && PROFILE=(--profile "$OUT/gpu.yaml")  # the plan part's calibration
  T=240 run breakdown.md plan breakdown --size "${BREAKDOWN_SIZES:-xl,2.7b}" --dtype bf16,fp32 \
    --batch-size "${PLAN_BATCH:-4}" "${PROFILE[@]}"
fi
# xl has 25 heads, which tp=2 does not divide: the multi-GPU parts take xl with 20 (scripts/gpu/xl-h20.yaml)
W2="--size scripts/gpu/xl-h20.yaml --dtype bf16 --batch-size 4 --context-length 512 --world-size 2 --backend nccl --impl lmsys,torch --warmup 3 --steps 10"
if part w2; then
  T=200 run w2.md parallel train --mesh tp=2 $W2
  T=200 run w2.md parallel train --mesh tp=2 --sequence-parallel $W2
  for s in gpipe 1f1b; do
    T=200 run w2.md parallel train --mesh pp=2 --pp-schedule $s --microbatches 8 $W2
  done
fi
W4="--size scripts/gpu/xl-h20.yaml --dtype bf16 --batch-size 4 --context-length 512 --world-size 4 --backend nccl --impl lmsys,torch --warmup 3 --steps 10"
if part w4; then
  for dp in bucketed fsdp; do T=200 run w4.md parallel train --mesh dp=2,tp=2 --dp-strategy $dp $W4; done
  T=200 run w4.md parallel train --mesh pp=2,tp=2 --microbatches 8 $W4
  T=200 run w4.md parallel train --mesh pp=4 --pp-schedule interleaved-1f1b --virtual-stages 2 --microbatches 8 $W4
fi
if part sendrecv; then
  T=200 run sendrecv.md comm send-recv --backend nccl --sizes 1KB,1MB,64MB,1GB --baseline
fi
echo "== done in $(elapsed)s"
} 2>&1 | tee -a "$OUT/parallel.log"

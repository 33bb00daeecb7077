#!/usr/bin/env bash
# Issue 11 on one 2-GPU machine (kind nvidia-h200-x2) in one device call (< 600 s): the most important
# tables first, each step under its own timeout and skipped when the call's budget would be passed.
#   a1  xl bf16 world 2: 1 process, bucketed 400 MiB, torch-ddp, fsdp, torch-fsdp (FSDP targets)
#   c   10b bf16 world 2 batch 2: baseline row OOM, fsdp vs torch-fsdp
#   comm  all-reduce, all-gather, reduce-scatter, broadcast 1MB..1GB with the bare loop
#   b1    the 1-process row, bucketed 400 MiB and the bucket-optimizer lever (the other levers measured
#         slower on 2026-12-01: docs/benchmarks/ddp.md)
#   zero  bucketed 400 MiB with --shard-optimizer (ZeRO-1), against a1's plain AdamW row
#   a2,a3 bucketed vs torch-ddp again (three repetitions in all)
#   nsys  where DDP's backward loses its time: nsys over a bucketed and a flat run (opt-in; carry .debs)
#   carve  DDP's SM carveout lever (cuBLAS leaves N SMs to NCCL while buckets reduce), with and
#          without fewer NCCL CTAs (NCCL's channel count goes to carve_default.log: NCCL_DEBUG=INIT)
#   ce    DDP's copy-engine lever: the 2-GPU tests, then bucketed (NCCL) vs +copy-engine vs torch-ddp
#         three times (medians), and copy-engine with 100 MiB buckets
#   reps  item 4's median: three rounds of {1 process, bucketed, torch-ddp}
#   repcomm  item 7's median: three rounds of the four collectives at 1 GB with the bare loop
# PARTS picks the parts (default: a1 c comm b1 zero a2 a3), in the order above. Every command is
# time-guarded (scripts/gpu/lib.sh, BUDGET default 575 s; DRY_RUN=1 prints them); $OUT comes back as all.tar.
set -u
OUT="${OUT:-lmsys-out/scale}"; BUDGET=${BUDGET:-575}
source scripts/gpu/lib.sh
PARTS=${PARTS:-a1 c comm b1 zero a2 a3}
XL="--size xl --dtype bf16 --batch-size 4 --context-length 512 --world-size 2 --backend nccl --warmup 3"
run() {  # name seconds lmsys-args...: the table to $OUT/name.md, the log to $OUT/name.log
  local name=$1 want=$2; shift 2
  echo "+ [$(elapsed)s] $name: lmsys $*"
  T=$want L "$@" --format md -o "$OUT/$name.md" > "$OUT/$name.log" 2>&1 \
    || echo "$name failed: $? after $(elapsed)s" | tee -a "$OUT/failures.txt"
}
{ date -u; X nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  X python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
} > "$OUT/env.txt" 2>&1
part a1 && run a1_xl 170 ddp train $XL --strategy bucketed,torch-ddp,fsdp,torch-fsdp --bucket-mb 400 --steps 10
part c && run c_10b 200 ddp train --size 10b --dtype bf16 --batch-size 2 --context-length 512 --world-size 2 \
  --backend nccl --warmup 2 --steps 5 --strategy fsdp,torch-fsdp
part comm && for c in allreduce all-gather reduce-scatter broadcast; do
  run "comm_$c" 35 comm "$c" --backend nccl --world-size 2 --sizes 1MB,100MB,1GB --warmup 5 --steps 20 --baseline
done
part b1 && run b1_levers 90 ddp train $XL --strategy bucketed --bucket-mb 400 --lever bucket-optimizer --steps 10
part zero && run zero1 60 ddp train $XL --strategy bucketed --bucket-mb 400 --steps 10 --shard-optimizer --no-baseline
part a2 && run a2_xl 45 ddp train $XL --strategy bucketed,torch-ddp --bucket-mb 400 --steps 10 --no-baseline
part a3 && run a3_xl 45 ddp train $XL --strategy bucketed,torch-ddp --bucket-mb 400 --steps 10 --no-baseline
# Where DDP's backward loses its time (issue 11 item 4; not run yet): nsys over a bucketed and a flat
# run (flat: the all-reduce after the backward, so the backward's kernels run alone), top kernels of
# each (GEMMs slowed by NCCL beside them, NCCL's own kernel time). Needs the .debs carried (DEVICE.md).
if { part nsys || [ "${NSYS_DDP:-0}" = 1 ]; } && have_time; then
  for s in bucketed flat; do
    echo "+ [$(elapsed)s] nsys_ddp_$s"
    T=150 L profile nsys --top 15 --out-dir "$OUT/nsys_$s" --format md -o "$OUT/nsys_ddp_$s.md" \
      -- python3 -m lmsys ddp train $XL --strategy $s --bucket-mb 400 --steps 3 --no-baseline > "$OUT/nsys_ddp_$s.log" 2>&1 \
      || echo "nsys_ddp_$s failed: $?" | tee -a "$OUT/failures.txt"
    rm -f "$OUT/nsys_$s"/*.nsys-rep "$OUT/nsys_$s"/*.sqlite  # large; the tables and CSVs stay
  done
fi
if part carve; then
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT run carve_default 100 ddp train $XL --strategy bucketed,torch-ddp \
    --bucket-mb 400 --sm-carveout 0,8,16,32 --steps 10
  run carve_ctas8 60 ddp train $XL --strategy bucketed --bucket-mb 400,100 --sm-carveout 8,16 --nccl-ctas 8 --steps 10 --no-baseline
  run carve_ctas4 60 ddp train $XL --strategy bucketed --bucket-mb 400 --sm-carveout 4,8 --nccl-ctas 4 --steps 10 --no-baseline
  run carve_ctas16 60 ddp train $XL --strategy bucketed --bucket-mb 400 --sm-carveout 16,24 --nccl-ctas 16 --steps 10 --no-baseline
fi
if part ce; then
  echo "+ [$(elapsed)s] copy-engine tests"
  ce_ok=1
  # the copy-engine tests alone first, with a barrier timeout shorter than the step's (a hang then ends
  # with the barrier's error) and the ranks' stderr in the log (LMSYS_DEBUG=1)
  LMSYS_DIST_TIMEOUT_S=45 LMSYS_DEBUG=1 T=120 X python3 -m pytest -q -rA tests/test_distributed_gpu.py \
    -k copy_engine > "$OUT/ce_tests.log" 2>&1 \
    || { ce_ok=0; echo "copy-engine tests failed: $? (copy-engine runs skipped)" | tee -a "$OUT/failures.txt"; }
  [ $ce_ok = 1 ] && for r in 1 2 3; do
    extra=""; [ $r = 1 ] && extra="--comm-dtype fp32,bf16"  # bf16 grads once: half the bytes beside the backward
    run "ce_$r" 90 ddp train $XL --strategy bucketed,torch-ddp --bucket-mb 400 --lever copy-engine $extra --steps 10
    [ $r = 1 ] && run ce_100 60 ddp train $XL --strategy bucketed --bucket-mb 100 --lever copy-engine --steps 10 --no-baseline
  done
  [ $ce_ok = 1 ] && T=90 X python3 -m pytest -q -rA tests/test_distributed_gpu.py -k "not copy_engine" \
    > "$OUT/gpu_tests.log" 2>&1  # the other 2-GPU tests, after the tables
fi
if part reps || part repcomm; then
  for r in 1 2 3; do
    part reps && run "reps_ddp_$r" 90 ddp train $XL --strategy bucketed,torch-ddp --bucket-mb 400 --steps 10
    part repcomm && for c in allreduce all-gather reduce-scatter broadcast; do
      run "reps_comm_${c}_$r" 25 comm "$c" --backend nccl --world-size 2 --sizes 1GB --warmup 5 --steps 20 --baseline
    done
  done
fi
echo "done in $(elapsed) s"
[ -f "$OUT/failures.txt" ] && cat "$OUT/failures.txt"
(cd "$OUT" && tar -cf all.tar --exclude all.tar . && find . -type f ! -name all.tar -delete)  # one file back
exit 0

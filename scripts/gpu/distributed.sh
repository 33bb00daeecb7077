#!/usr/bin/env bash
# Issue 11 items 1-4 on one 2-GPU machine (kind nvidia-h200-x2), ~9 minutes. From the repository root:
#     bash scripts/gpu/distributed.sh        # tables under $OUT (default lmsys-out/distributed)
# Every step has its own `timeout` (sum 540 s); a failing step does not stop the next one.
#   a) xl bf16 world 2: bucketed 400 MiB, torch-ddp, fsdp, torch-fsdp (10 timed steps), then the
#      bucketed vs torch-ddp pair twice more (three repetitions: median and spread of scaling eff %).
#      Read: fsdp ms/step <= 0.90 x torch-fsdp ms/step, fsdp peak MiB/rank <= torch-fsdp's.
#   b) the DDP levers, one row each on top of bucketed 400 MiB, + NCCL CTAs (a separate run: env).
#   c) 10b bf16 world 2 batch 2: the baseline row says OOM; fsdp ms/step <= torch-fsdp's.
set -x
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-lmsys-out/distributed}"
mkdir -p "$OUT"
L="python3 -m lmsys"
XL="--size xl --dtype bf16 --batch-size 4 --context-length 512 --world-size 2 --backend nccl --warmup 3"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} > "$OUT/env.txt" 2>&1

step() {  # name seconds args...
  local name=$1 secs=$2; shift 2
  timeout "$secs" $L ddp train "$@" --format md -o "$OUT/$name.md" > "$OUT/$name.log" 2>&1 \
    || echo "$name failed: $?" | tee -a "$OUT/failures.txt"
}

# a) ~150 s: the four strategies, then two more bucketed/torch-ddp pairs (no baseline rerun: 1 process
#    is in a1; with --no-baseline the pair's scaling is computed from a1's 1-process row by hand).
step a1_xl_strategies 180 $XL --strategy bucketed,torch-ddp,fsdp,torch-fsdp --bucket-mb 400 --steps 10
step a2_xl_pair 50 $XL --strategy bucketed,torch-ddp --bucket-mb 400 --steps 10 --no-baseline
step a3_xl_pair 50 $XL --strategy bucketed,torch-ddp --bucket-mb 400 --steps 10 --no-baseline

# b) ~110 s: levers (learned bucket order, gradient views, per-bucket optimizer, bf16 grads) ...
step b1_xl_levers 100 $XL --strategy bucketed --bucket-mb 400 --comm-dtype fp32 \
  --lever learned-order,grad-views,bucket-optimizer --steps 10 --no-baseline
# ... and NCCL CTAs (process-wide, so its own run), with bf16 gradients for the same cap
step b2_xl_ctas 50 $XL --strategy bucketed --bucket-mb 400 --comm-dtype fp32,bf16 --nccl-ctas 4 --steps 10 --no-baseline

# c) ~60 s: 10b does not fit one GPU: the baseline row is OOM (the estimate), the strategies run
step c_10b 110 --size 10b --dtype bf16 --batch-size 2 --context-length 512 --world-size 2 --backend nccl \
  --warmup 2 --steps 5 --strategy fsdp,torch-fsdp

set +x
for f in "$OUT"/*.md; do echo "== $f"; cat "$f"; done
[ -f "$OUT/failures.txt" ] && { echo "== failures"; cat "$OUT/failures.txt"; }
exit 0

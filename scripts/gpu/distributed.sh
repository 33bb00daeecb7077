#!/usr/bin/env bash
# Distributed runs on 2 GPUs (kind nvidia-h200-x2): issue 4's performance questions, the 2-GPU part of
# issue 6. From the repository root:
#     bash scripts/gpu/distributed.sh            # logs and tables under $OUT (default lmsys-out/distributed)
# Budget: every step has its own `timeout`; the sum of them is 555 s (steps took 40+20+90+65+60 s on
# 2026-11-30). A failing step does not
# stop the next one. What to look for is in docs/benchmarks/comm.md and docs/benchmarks/ddp.md.
set -x
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-lmsys-out/distributed}"
mkdir -p "$OUT"
L="python3 -m lmsys"
XL="--size xl --dtype bf16 --batch-size 4 --context-length 512 --world-size 2 --backend nccl"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} > "$OUT/env.txt" 2>&1

# 0. NCCL correctness (sum check, parity of every strategy on a tiny model): ~40 s
timeout 60 python3 -m pytest -q tests/test_distributed_gpu.py > "$OUT/0_gpu_tests.log" 2>&1 \
  || echo "step 0 (gpu tests) failed: $?" | tee -a "$OUT/failures.txt"

# 1. all-reduce table, world size 2, next to a bare torch.distributed loop in the same run. Look for:
#    the 'per-round' busbw at 1GiB >= 0.95 x the 'bare loop' busbw at 1GiB (anchor: ~312 GB/s).
timeout 75 $L comm allreduce --backend nccl --world-size 2 --sizes 1MB,10MB,100MB,1GB,1GiB \
  --warmup 5 --iters 20 --baseline --format md --output "$OUT/1_comm_nccl.md" \
  > "$OUT/1_comm_nccl.log" 2>&1 || echo "step 1 (comm allreduce) failed: $?" | tee -a "$OUT/failures.txt"

# 2. DDP, xl, bf16, batch 4 per rank, context 512: every strategy + torch-ddp + the 1-process row
#    (scaling efficiency). Look for: bucketed ms/step <= torch-ddp and <= 1.10 x the '1 process' row.
timeout 200 $L ddp train $XL --strategy naive,flat,overlap,bucketed,torch-ddp,fsdp \
  --bucket-mb 25,100 --comm-dtype fp32,bf16 --warmup 3 --steps 6 \
  --format md --output "$OUT/2_ddp_xl.md" > "$OUT/2_ddp_xl.log" 2>&1 \
  || echo "step 2 (ddp train xl) failed: $?" | tee -a "$OUT/failures.txt"

# 2b. bucket sizes against torch DDP with 20 timed steps (step 2's 6 are noisy): ~65 s.
timeout 100 $L ddp train $XL --strategy bucketed,torch-ddp --bucket-mb 100,200,400 --warmup 3 --steps 20 \
  --format md --output "$OUT/2b_ddp_xl_buckets.md" > "$OUT/2b_ddp_xl_buckets.log" 2>&1 \
  || echo "step 2b (ddp train xl buckets) failed: $?" | tee -a "$OUT/failures.txt"

# 3. ShardedOptimizer (ZeRO-1): peak memory per rank and step time with it; compare with the same
#    rows of step 2 (without). Look for: peak MiB/rank lower by about half of AdamW's state.
timeout 120 $L ddp train $XL --strategy bucketed,torch-ddp --bucket-mb 100 --shard-optimizer \
  --warmup 3 --steps 6 --format md --output "$OUT/3_ddp_xl_zero1.md" > "$OUT/3_ddp_xl_zero1.log" 2>&1 \
  || echo "step 3 (ddp train xl --shard-optimizer) failed: $?" | tee -a "$OUT/failures.txt"

set +x
for f in "$OUT"/1_comm_nccl.md "$OUT"/2_ddp_xl.md "$OUT"/2b_ddp_xl_buckets.md "$OUT"/3_ddp_xl_zero1.md; do
  [ -f "$f" ] && { echo "== $f"; cat "$f"; }
done
[ -f "$OUT/failures.txt" ] && { echo "== failures"; cat "$OUT/failures.txt"; }
exit 0

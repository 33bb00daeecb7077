#!/usr/bin/env bash
# Collectives and ZeRO-1 on 2 GPUs (kind nvidia-h200-x2), issue 11 items 5 and 7. From the repository root:
#     bash scripts/gpu/comm.sh             # tables and logs under $OUT (default /tmp/lmsys-out)
# Budget: ~2 min for the four collectives (1MB..1GB sweep, nccl, world 2, bare-loop baseline each), ~3 min
# for ZeRO-1 (xl bf16, bucketed 400 MiB, 10 timed steps, without and with --shard-optimizer); BUDGET
# caps the whole script (default 450 s). A failing step does not stop the next one.
# What to read:
#   comm_*.md: per collective, the 1GB 'per-round' busbw against the 1GB 'bare loop' busbw (target
#     >= 0.95x); correct = yes on every per-round row; op = all_gather_into_tensor / reduce_scatter_tensor
#     on torch 2.11 (no fallback with nccl).
#   zero1_*.md: ms/step and optimizer ms of 'AdamW, ZeRO-1 sharded' against plain 'AdamW' (target: step
#     <= 1.05x), peak MiB/rank, and optim MiB/rank where the fsdp lane's column is merged (target:
#     sharded <= (1/2 + 5 %) of plain); parity max|Δθ| equal in both files.
set -u
source scripts/gpu/lib.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUDGET=${BUDGET:-450}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; env_line
  python3 -c "import torch; print('nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} > "$OUT/env.txt" 2>&1

for c in allreduce all-gather reduce-scatter broadcast; do
  T=60 L comm "$c" --backend nccl --world-size 2 --sizes 1MB,10MB,100MB,1GB --warmup 5 --iters 20 \
    --baseline --format md --output "$OUT/comm_$c.md" > "$OUT/comm_$c.log" 2>&1
done

XL="--backend nccl --size xl --dtype bf16 --world-size 2 --strategy bucketed --bucket-mb 400 --warmup 3 --steps 10"
T=150 L ddp train $XL --format md --output "$OUT/zero1_plain.md" > "$OUT/zero1_plain.log" 2>&1
T=150 L ddp train $XL --shard-optimizer --format md --output "$OUT/zero1_sharded.md" > "$OUT/zero1_sharded.log" 2>&1

for f in "$OUT"/comm_*.md "$OUT"/zero1_*.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
echo "== done in $(elapsed) s"
exit 0

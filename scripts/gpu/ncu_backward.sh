#!/usr/bin/env bash
# Nsight Compute on flash-triton's one-launch backward (the Gluon kernel) at the leaderboard shape (bf16,
# causal, batch 1, 16 heads, seq 16384, d ${D:-128}): the full section set with per-instruction warp-stall
# samples, written as text under $OUT (the report itself too): where the kernel's time goes, line by line
# of SASS. Run on an H100/H200: PYTHONPATH=src OUT=/tmp/ncu bash scripts/gpu/ncu_backward.sh
set -u
NCU=${NCU:-$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
[ -x "$NCU" ] || { echo "ncu not found (set NCU)"; exit 2; }
mkdir -p "$OUT"
cat > /tmp/ncu_bwd.py <<PY
import torch
from lmsys.kernels import flash_triton
q, k, v, do = (torch.randn(1, 16, 16384, ${D:-128}, device="cuda", dtype=torch.bfloat16) for _ in range(4))
o, lse = flash_triton.flash_forward(q, k, v, True)
for _ in range(2):
    flash_triton.flash_backward(q, k, v, o, lse, do, True)
torch.cuda.synchronize()
PY
"$NCU" --kernel-name regex:_attn_bwd_ws --launch-skip 1 --launch-count 1 --set full --import-source yes \
    -f -o "$OUT/bwd" python3 /tmp/ncu_bwd.py > "$OUT/ncu_log.txt" 2>&1 || tail -20 "$OUT/ncu_log.txt"
"$NCU" --import "$OUT/bwd.ncu-rep" --page details > "$OUT/details.txt" 2>&1
"$NCU" --import "$OUT/bwd.ncu-rep" --page source --csv --print-source sass > "$OUT/source.csv" 2>&1 \
    || "$NCU" --import "$OUT/bwd.ncu-rep" --page source --csv > "$OUT/source.csv" 2>&1
head -c 600 "$OUT/source.csv"; echo; grep -E "Duration|Registers|Stall|Issue Slots|Eligible|Active Warps|Throughput" "$OUT/details.txt" | head -40

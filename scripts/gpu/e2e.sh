#!/usr/bin/env bash
# Issues 2 and 7 on one H200 (kind nvidia-h200), in one device call (~8 min):
#   the e2e baseline (fp32, bf16, warm-up 0/1/2/5), the fast path against the plain model
#   (--compare) at 2.7b bf16 and small fp32, large at context 16384, and an eager ablation of
#   each fast-path choice. Results land in $OUT as Markdown (one file per question) + a log.
# Run from the repo root:  bash scripts/gpu/e2e.sh   (PYTHONPATH=src; nothing is installed)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/lmsys-out}; mkdir -p "$OUT"
L() { echo "+ lmsys $*" >&2; timeout 300 python3 -m lmsys "$@" || echo "!! exit $? for: lmsys $*" >&2; }
{
python3 -c "import torch, triton, typer; print('torch', torch.__version__, 'triton', triton.__version__, 'typer', typer.__version__, torch.cuda.get_device_name())"
date -u

# Issue 7 targets (each in one process: plain eager, plain compiled, lmsys fast path).
L bench e2e --size 2.7b --dtype bf16 --fast --compare --warmup 3 --steps 10 -f md -o "$OUT/e2e_compare_2.7b_bf16.md"
L bench e2e --size small --dtype fp32 --fast --compare --warmup 3 --steps 10 -f md -o "$OUT/e2e_compare_small_fp32.md"
L bench e2e --size large --context-length 16384 --dtype bf16 --fast --checkpoint none,block --warmup 1 --steps 3 -f md -o "$OUT/e2e_large_16k.md"
L bench e2e --size large --context-length 16384 --dtype bf16 --attn naive --warmup 0 --steps 1 -f md >> "$OUT/e2e_large_16k.md"

# Ablation at 2.7b bf16, eager (no compile), one switch at a time.
for flags in "--optimizer adamw" "--optimizer adamw-fused" "--master-weights" "--master-weights --attn sdpa" \
             "--master-weights --attn flash-triton" "--master-weights --attn flash-triton --fused-ce on"; do
  L bench e2e --size 2.7b --dtype bf16 $flags --warmup 2 --steps 5 -f md >> "$OUT/e2e_ablation_2.7b.md"
done
L bench e2e --size 2.7b --dtype bf16 --fast --compile --warmup 3 --steps 5 -f md >> "$OUT/e2e_ablation_2.7b.md"

# Issue 2 baseline: the plain defaults (naive attention), every mode, fp32 and bf16; warm-up study.
L bench e2e --size small,medium,large,xl,2.7b --mode all --warmup 2 --steps 5 -f md -o "$OUT/e2e_baseline_fp32.md"
L bench e2e --size small,medium,large,xl,2.7b --mode all --dtype bf16 --warmup 2 --steps 5 -f md -o "$OUT/e2e_baseline_bf16.md"
for w in 0 1 2 5; do L bench e2e --size small --warmup $w --steps 10 -f md >> "$OUT/e2e_warmup_small.md"; done
} 2>&1 | tee "$OUT/e2e.log"

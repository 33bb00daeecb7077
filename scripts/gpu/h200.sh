#!/usr/bin/env bash
# One device call on kind nvidia-h200 (carry [".debs"]) for issues 2, 5 and 7, most important first,
# every command under a timeout and the whole under TOTAL seconds (default 560): what does not fit is
# skipped and says so. Results: $OUT/h200.log, $OUT/results.tar (Markdown tables, fixtures, PNGs).
# Seen 2026-11-30: with TOTAL=470 it got through the small nsys runs of step 4 and no further; plan
# two calls of TOTAL=560 for the whole list. --fast has changed since: see docs/benchmarks/e2e.md.
#   1. issue 7: 2.7b bf16 fast path vs plain eager / plain compiled (--compare)
#   2. issue 5: fixtures for the CPU tests (raw nsys stats CSVs, a tiny memory snapshot, the qdstrm failure)
#   3. issue 7: small fp32 --compare; large at context 16384 with flash attention
#   4. issue 5: memory of large (train, contexts 128/256/512, fp32 vs bf16); nsys of small/large x 128/256/512
#   5. issue 2: baseline --mode all fp32 and bf16 over small..2.7b; warm-up 0/1/2/5 on small
#   6. issue 7: eager ablation of each fast-path switch at 2.7b bf16
ORIG_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
mkdir -p /tmp/dw && for f in .debs/*.deb; do dpkg -x $f /tmp/dw; done
export LD_LIBRARY_PATH=/tmp/dw/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/lmsys-out}; R=/tmp/lmsys-results; W=/tmp/lmsys-work
rm -rf "$R" "$W"; mkdir -p "$OUT" "$R/fixtures/nsys" "$R/fixtures/memory" "$W"
TOTAL=${TOTAL:-560}; START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
L() {  # L SECONDS lmsys-args...: run under min(SECONDS, time left); skip when under 20 s remain
  local want=$1; shift; local left=$(( TOTAL - $(elapsed) )); local t=$(( want < left ? want : left ))
  if [ "$t" -lt 20 ]; then echo "!! [$(elapsed)s] skipped (time): lmsys $*" >&2; return 0; fi
  echo "+ [$(elapsed)s] lmsys $*" >&2
  timeout "$t" python3 -m lmsys "$@"; local rc=$?; [ $rc -eq 0 ] || echo "!! exit $rc for: lmsys $*" >&2; return 0
}
md() { echo; echo "#### \`lmsys $*\`"; echo; }
{
date -u; nvidia-smi -L
python3 -c "import torch, triton, typer; print('torch', torch.__version__, 'triton', triton.__version__, 'typer', typer.__version__, torch.cuda.get_device_name())"

Q="bench e2e --size 2.7b --dtype bf16 --fast --compare --warmup 3 --steps 10"
{ md $Q; L 240 $Q -f md; } >> "$R/e2e_compare.md"

FIX="profile nsys --size tiny --context-length 128 --batch-size 4 --warmup 2 --steps 2 --annotate-attention"
{ md $FIX; L 60 $FIX --out-dir "$W/nsys" -f md; } >> "$R/profile_nsys.md"
for r in nvtx_sum nvtx_kern_sum cuda_gpu_kern_sum cuda_api_sum nvtx_pushpop_trace cuda_gpu_trace; do
  f=$(ls "$W"/nsys/nsys_tiny_ctx128_*${r}*.csv 2>/dev/null | head -1)
  [ -n "$f" ] && cp "$f" "$R/fixtures/nsys/${r}.csv" || echo "!! no CSV for $r"
done
{ echo "# How these CSVs were made"; echo; echo "$(date -u +%F), $(nvidia-smi -L | head -1), $(python3 -c 'import torch; print("torch", torch.__version__)')"
  echo; echo '```'; echo "PYTHONPATH=src python3 -m lmsys $FIX --out-dir \$DIR"; echo '```'; echo
  grep -h '^\$ ' "$W"/nsys/nsys_tiny_ctx128_*.log 2>/dev/null | sed 's/^/    /'; } > "$R/fixtures/nsys/COMMAND.md"
L 45 profile memory --size tiny --context-length 128 --batch-size 4 --steps 2 --out-dir "$W/memtiny" -f md
cp "$W"/memtiny/*train.pickle "$R/fixtures/memory/snapshot_tiny_train.pickle" 2>/dev/null || echo "!! no tiny snapshot"
NSYS_BIN=$(python3 -c "from lmsys.profiling.nsys import find_nsys; print(find_nsys())")
mkdir -p "$W/q"; LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" timeout 60 "$NSYS_BIN" profile --trace=cuda --output="$W/q/noimport" \
  --force-overwrite=true python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" > "$W/q/out.txt" 2>&1
cat "$W/q/out.txt"; ls "$W/q"
[ ! -f "$W/q/noimport.nsys-rep" ] && cp "$W/q/out.txt" "$R/fixtures/nsys/qdstrm_failure.txt"
LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" L 40 profile nsys --out-dir "$W/q2" -- python3 -c "import torch; torch.zeros(1, device='cuda')"

Q="bench e2e --size small --dtype fp32 --fast --compare --warmup 3 --steps 10"
{ md $Q; L 120 $Q -f md; } >> "$R/e2e_compare.md"
Q="bench e2e --size large --context-length 16384 --dtype bf16 --fast --checkpoint none,block --warmup 1 --steps 3"
{ md $Q; L 90 $Q -f md; } >> "$R/e2e_compare.md"
Q="bench e2e --size large --context-length 16384 --dtype bf16 --attn naive --warmup 0 --steps 1"
{ md $Q; L 40 $Q -f md; } >> "$R/e2e_compare.md"

for dt in fp32 bf16; do
  Q="profile memory --size large --context-length 128,256,512 --batch-size 4 --dtype $dt --mode train --steps 2"
  { md $Q; L 70 $Q --out-dir "$W/mem" -f md; } >> "$R/profile_memory.md"
done
cp "$W"/mem/*.png "$R/" 2>/dev/null
for run in "small 128" "small 256" "small 512" "large 128" "large 256" "large 512"; do
  set -- $run
  Q="profile nsys --size $1 --context-length $2 --batch-size 4 --warmup 2 --steps 3 --annotate-attention --trace cuda,nvtx"
  { md $Q; L 45 $Q --out-dir "$W/nsys" -f md; } >> "$R/profile_nsys.md"
done

for dt in fp32 bf16; do
  Q="bench e2e --size small,medium,large,xl,2.7b --mode all --dtype $dt --warmup 2 --steps 5"
  { md $Q; L 100 $Q -f md; } >> "$R/e2e_baseline.md"
done
for w in 0 1 2 5; do Q="bench e2e --size small --warmup $w --steps 10"; { md $Q; L 25 $Q -f md; } >> "$R/e2e_baseline.md"; done

for flags in "--optimizer adamw" "--optimizer adamw-fused" "--master-weights" "--master-weights --attn sdpa" \
             "--master-weights --attn flash-triton" "--master-weights --attn flash-triton --fused-ce on"; do
  Q="bench e2e --size 2.7b --dtype bf16 $flags --warmup 2 --steps 5"; { md $Q; L 40 $Q -f md; } >> "$R/e2e_ablation.md"
done
echo "== done in $(elapsed)s"
} 2>&1 | tee "$OUT/h200.log"
tar -C "$R" -cf "$OUT/results.tar" . && tar -tvf "$OUT/results.tar"

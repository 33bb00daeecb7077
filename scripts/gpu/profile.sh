#!/usr/bin/env bash
# Issue 5 (profiling) on one H200, in one device call (kind nvidia-h200, carry [".debs"], < 8 min).
#   1. fixtures for the CPU tests: raw `nsys stats` CSVs of a real `profile nsys` run, the importer's
#      output when libdw is missing, a `tiny` memory snapshot; the profile tests then run against them;
#   2. the issue's GPU questions, answered by the tool: nvtx_sum (+ top forward kernel, attention
#      matmul/softmax split) for small and large at contexts 128/256/512; memory peaks of `large` at
#      contexts 128/256/512, fp32 vs bf16, forward and train step, with the timeline PNGs.
# Run from the repo root:  bash scripts/gpu/profile.sh    (PYTHONPATH=src; nothing is installed)
# $OUT gets: README.md, profile.log, profile_nsys.md, profile_memory.md, fixtures.tar, memory_png.tar,
#            memory_large_ctx512_fp32_train.png
# PARTS picks the steps (default "fixtures gputests memtrain nsys memfwd"); NSYS_SIZES the presets of the nsys
# step (default "small large") and NSYS_CTX its contexts (default "128 256 512"); BUDGET the seconds in all
# (default 465; scripts/gpu/lib.sh, which also unpacks the .debs nsys's importer needs; DRY_RUN=1 prints
# the commands instead).
set -u
source scripts/gpu/lib.sh
PARTS=${PARTS:-fixtures gputests memtrain nsys memfwd}; NSYS_SIZES=${NSYS_SIZES:-small large}; NSYS_CTX=${NSYS_CTX:-128 256 512}
W=/tmp/lmsys-profile-$$; rm -rf "$W"; mkdir -p "$W/fixtures/nsys" "$W/fixtures/memory"

{
echo "== environment"
date -u
X nvidia-smi -L
X python3 -c "import torch, typer, matplotlib; print('torch', torch.__version__, 'typer', typer.__version__, 'matplotlib', matplotlib.__version__, torch.cuda.get_device_name())"
NSYS_BIN=$(X python3 -c "from lmsys.profiling.nsys import find_nsys; print(find_nsys())"); NSYS_BIN=${NSYS_BIN:-nsys}
echo "nsys: $NSYS_BIN"; X "$NSYS_BIN" --version
IMPORTER=$(X python3 -c "from lmsys.profiling.nsys import find_importer; print(find_importer('$NSYS_BIN') or '')")
echo "importer: ${IMPORTER:-not found}"
if [ -n "$IMPORTER" ]; then
  echo "ldd without the .debs:"; LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" ldd "$IMPORTER" | grep -i "not found" || echo "  (nothing missing)"
  echo "ldd with the .debs:"; ldd "$IMPORTER" | grep -i "not found" || echo "  (nothing missing)"
fi

if part fixtures; then
echo "== 1a. nsys fixture run (tiny, default --trace)"
FIX="profile nsys --size tiny --context-length 128 --batch-size 4 --warmup 2 --steps 2 --annotate-attention"
echo "#### \`lmsys $FIX\`" >> "$OUT/profile_nsys.md"
L $FIX --out-dir "$W/nsys" -f md | tee -a "$OUT/profile_nsys.md"
ls -la "$W/nsys"
for r in nvtx_sum nvtx_kern_sum cuda_gpu_kern_sum cuda_api_sum nvtx_pushpop_trace cuda_gpu_trace; do
  f=$(ls "$W"/nsys/nsys_tiny_ctx128_*${r}*.csv 2>/dev/null | head -1)
  [ -n "$f" ] && cp "$f" "$W/fixtures/nsys/${r}.csv" || echo "!! no CSV for $r"
done
[ -n "${DRY_RUN:-}" ] || {
  echo "# How these CSVs were made"; echo
  echo "$(date -u +%F), $(nvidia-smi -L | head -1), $("$NSYS_BIN" --version), $(python3 -c 'import torch; print("torch", torch.__version__)')"; echo
  echo '```'; echo "PYTHONPATH=src python3 -m lmsys $FIX --out-dir \$DIR"; echo '```'; echo
  echo "which ran (from the run's log; each stats report's CSV was copied here as <report>.csv):"; echo
  echo '```'; grep '^\$ ' "$W"/nsys/nsys_tiny_ctx128_*.log; echo '```'
} > "$W/fixtures/nsys/COMMAND.md"

echo "== 1b. memory fixture (tiny)"
L profile memory --size tiny --context-length 128 --batch-size 4 --steps 2 --out-dir "$W/memtiny" -f md
cp "$W"/memtiny/memory_tiny_ctx128_b4_fp32_train.pickle "$W/fixtures/memory/snapshot_tiny_train.pickle"
ls -la "$W/fixtures/memory"

echo "== 1c. nsys without libdw (the importer failure, raw and as lmsys reports it)"
mkdir -p "$W/q"
LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" T=90 X "$NSYS_BIN" profile --trace=cuda --output="$W/q/noimport" \
  --force-overwrite=true python3 -c "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()" \
  > "$W/q/nsys_output.txt" 2>&1
cat "$W/q/nsys_output.txt"; ls -la "$W/q"
if [ ! -f "$W/q/noimport.nsys-rep" ] && ls "$W"/q/*.qdstrm >/dev/null 2>&1; then
  cp "$W/q/nsys_output.txt" "$W/fixtures/nsys/qdstrm_failure.txt"
else
  echo "!! nsys without the .debs did not leave only a .qdstrm: no qdstrm_failure.txt fixture"
fi
LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" T=90 L profile nsys --out-dir "$W/q2" -- python3 -c "import torch; torch.zeros(1, device='cuda')"

tar -C "$W" -cf "$OUT/fixtures.tar" fixtures
tar -tvf "$OUT/fixtures.tar"

X cp -r "$W"/fixtures/. tests/fixtures/
fi
if part gputests; then
echo "== 1d. the profile tests (against the fixtures just captured, when part fixtures ran), on the GPU"
T=150 X python3 -m pytest -q -rfs tests/test_profile_nvtx.py tests/test_profile_nsys.py tests/test_profile_torch.py \
  tests/test_profile_memory.py 2>&1 | tail -40
fi

mem() {  # mem DTYPE MODE: the context sweep of large
  local Q="profile memory --size large --context-length 128,256,512 --batch-size 4 --dtype $1 --mode $2 --steps 2"
  have_time && echo "#### \`lmsys $Q\`" >> "$OUT/profile_memory.md"
  T=200 L $Q --out-dir "$W/mem" -f md | tee -a "$OUT/profile_memory.md"
}
if part memtrain; then
echo "== 2a. memory of large, train step: contexts 128/256/512, fp32 vs bf16 [$(elapsed)s]"
mem fp32 train
mem bf16 train
fi

echo "== 2b. nvtx_sum, top forward kernel, attention split: small and large at 128/256/512 [$(elapsed)s]"
# (--trace cuda,nvtx: the questions need no osrt/cuBLAS rows, and the reports import faster)
for size in $NSYS_SIZES; do for ctx in $NSYS_CTX; do
  part nsys || continue
  set -- $size $ctx
  Q="profile nsys --size $1 --context-length $2 --batch-size 4 --warmup 2 --steps 3 --annotate-attention --trace cuda,nvtx"
  have_time && echo "#### \`lmsys $Q\`" >> "$OUT/profile_nsys.md"
  L $Q --out-dir "$W/nsys" -f md | tee -a "$OUT/profile_nsys.md"
done; done

if part memfwd; then
echo "== 2c. memory of large, forward only [$(elapsed)s]"
mem fp32 fwd
mem bf16 fwd
fi
P="$W/mem/memory_large_ctx512_b4_fp32_train.pickle"
if [ -f "$P" ]; then
  echo "#### \`lmsys profile memory --snapshot memory_large_ctx512_b4_fp32_train.pickle --top 12\` (the fp32 train run above)" >> "$OUT/profile_memory.md"
  T=60 L profile memory --snapshot "$P" --out-dir "$W/mem/detail" --top 12 -f md | tee -a "$OUT/profile_memory.md"
  cp "$W/mem/memory_large_ctx512_b4_fp32_train.png" "$OUT/memory_large_ctx512_fp32_train.png"
fi
ls -la "$W/mem"
(cd "$W/mem" && tar -cf "$OUT/memory_png.tar" *.png) 2>/dev/null; tar -tf "$OUT/memory_png.tar" 2>/dev/null

cat > "$OUT/README.md" <<EOF
# scripts/gpu/profile.sh output ($(date -u +%F), $(nvidia-smi -L | head -1))
- profile.log: everything this script printed (environment, nsys/importer checks, test run, timings)
- profile_nsys.md: lmsys profile nsys tables, small and large at contexts 128/256/512 (command above each)
- profile_memory.md: lmsys profile memory sweeps of large (fp32/bf16, train/fwd) + a detailed render
- memory_png.tar: the timeline PNGs; memory_large_ctx512_fp32_train.png: one of them
- fixtures.tar: fixtures/nsys/*.csv + COMMAND.md (+ qdstrm_failure.txt), fixtures/memory/snapshot_tiny_train.pickle;
  untar into tests/ (tests/fixtures/...) to replace the placeholders
EOF
rm -rf "$W"  # reports and snapshots stay on the machine otherwise, one folder per run
echo "== done in $(elapsed)s"
} 2>&1 | tee "$OUT/profile.log"

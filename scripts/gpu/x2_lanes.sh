#!/usr/bin/env bash
# Two single-GPU scripts at once on kind nvidia-h200-x2 (carry [".debs"]): LANE0 on GPU 0, LANE1 on
# GPU 1, each with its own $OUT/lane0|lane1,
# packed into $OUT/lanes.tar at the end. The GPUs are separate; what they share is the host's 32
# cores (torch.compile runs on them), so timings are read within one lane's run, never across lanes.
#   LANE0="PARTS='compare 16k' bash scripts/gpu/e2e.sh" LANE1="bash scripts/gpu/profile.sh" bash scripts/gpu/x2_lanes.sh
# Without LANE0 and LANE1: attention.sh on GPU 0 beside e2e.sh on GPU 1.
set -u
OUT=${OUT:-/tmp/lmsys-out}
source scripts/gpu/lib.sh  # unpack the .debs once, before the lanes start
LANE0=${LANE0-bash scripts/gpu/attention.sh}; LANE1=${LANE1-bash scripts/gpu/e2e.sh}
for i in 0 1; do
  var=LANE$i; [ -n "${!var:-}" ] || continue
  dir="$OUT/lane$i"; mkdir -p "$dir"
  if [ -n "${DRY_RUN:-}" ]; then  # one lane after the other, their DRY lines on this script's stderr
    (export CUDA_VISIBLE_DEVICES=$i OUT="$dir"; eval "${!var}" > "$dir/stdout.txt")
  else
    (export CUDA_VISIBLE_DEVICES=$i OUT="$dir"; eval "${!var}" > "$dir/stdout.txt" 2>&1) &
  fi
done
wait
for i in 0 1; do [ -f "$OUT/lane$i/stdout.txt" ] && { echo "== lane $i"; tail -5 "$OUT/lane$i/stdout.txt"; }; done
lanes=$(cd "$OUT" && ls -d lane0 lane1 2>/dev/null)
[ -n "$lanes" ] && tar -C "$OUT" -cf "$OUT/lanes.tar" $lanes && (cd "$OUT" && rm -rf $lanes)

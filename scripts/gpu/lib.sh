# Sourced by the device scripts here: the environment of a run on the GPU machine, and `L`, an `lmsys`
# call under a timeout that never passes the script's BUDGET (seconds since the script started).
#   T=SECONDS L lmsys-args...   at most T seconds (default 150); skipped, and said so, under 25 s left
#   md lmsys-args...            a Markdown heading with the command, above its table
#   have_time                   true when L would still run a command
#   part NAME                   true when NAME is in $PARTS (a script's default list when unset)
# nsys's importer needs libdw.so.1, absent from the image (../shared/DEVICE.md): unpack the carried .debs
# (kept apart from ORIG_LD_LIBRARY_PATH, which reproduces the importer failure for a fixture).
ORIG_LD_LIBRARY_PATH=$(echo "${LD_LIBRARY_PATH:-}" | tr ':' '\n' | grep -v '^/tmp/dw/' | paste -sd: -)
DW=/tmp/dw/usr/lib/x86_64-linux-gnu
[ -e "$DW/libdw.so.1" ] || { mkdir -p /tmp/dw && for f in .debs/*.deb; do dpkg -x "$f" /tmp/dw; done; }
export LD_LIBRARY_PATH=$DW${ORIG_LD_LIBRARY_PATH:+:$ORIG_LD_LIBRARY_PATH}
export PYTHONPATH=src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/lmsys-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-465}; START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
L() {
  local want=${T:-150} left=$(( BUDGET - $(elapsed) )); local t=$(( want < left ? want : left ))
  if [ "$t" -lt 25 ]; then echo "!! [$(elapsed)s] skipped (time): lmsys $*" >&2; return 0; fi
  echo "+ [$(elapsed)s] lmsys $*" >&2
  timeout "$t" python3 -m lmsys "$@"; local rc=$?
  [ $rc -eq 0 ] || echo "!! [$(elapsed)s] exit $rc for: lmsys $*" >&2; return 0
}
have_time() { [ $(( BUDGET - $(elapsed) )) -ge 25 ]; }  # what L needs to run a command
md() { printf '\n#### `lmsys %s`\n\n' "$*"; }
part() { [[ " $PARTS " == *" $1 "* ]]; }
env_line() {
  python3 -c "import torch, triton; print(torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__)"
}

# Sourced by every device script here (run from the repository root: the package comes from src/, nothing
# is installed): the environment of a run on the GPU machine (../shared/DEVICE.md), and
#   T=SECONDS L lmsys-args...   `python3 -m lmsys ARGS` for at most T seconds (default 150) and never past
#                               the script's BUDGET (seconds since it started); under 25 s left: skipped, said
#                               so; returns the command's exit status (also said on stderr when not 0)
#   T=SECONDS X command...      any other command, the same way
#   md lmsys-args...            a Markdown heading with the command, above its table
#   have_time                   true when L would still run a command
#   part NAME                   true when NAME is in $PARTS (the script's default list when unset; "all": every part)
# DRY_RUN=1: L and X print what they would run ("DRY: COMMAND", shell-quoted, on the stderr the script
# started with, whatever a caller redirected) and run nothing;
# tests/test_scripts.py runs every script so and parses each lmsys command it names.
# nsys's importer needs libdw.so.1, absent from the image (DEVICE.md): the carried .debs are unpacked to
# /tmp/dw (kept apart from ORIG_LD_LIBRARY_PATH, which reproduces the importer failure for a fixture).
ORIG_LD_LIBRARY_PATH=$(echo "${LD_LIBRARY_PATH:-}" | tr ':' '\n' | grep -v '^/tmp/dw/' | paste -sd: -)
DW=/tmp/dw/usr/lib/x86_64-linux-gnu
if [ -z "${DRY_RUN:-}" ] && [ ! -e "$DW/libdw.so.1" ] && ls .debs/*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/dw && for f in .debs/*.deb; do dpkg -x "$f" /tmp/dw; done
fi
export LD_LIBRARY_PATH=$DW${ORIG_LD_LIBRARY_PATH:+:$ORIG_LD_LIBRARY_PATH}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
OUT=${OUT:-/tmp/lmsys-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-465}; START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
exec 9>&2  # the script's own stderr, for DRY_RUN's lines
_budgeted() {  # what L and X share: the time guard, the log line, the exit status
  local want=${T:-150} left=$(( BUDGET - $(elapsed) )); local t=$(( want < left ? want : left ))
  if [ -n "${DRY_RUN:-}" ]; then echo "DRY: $(printf '%q ' "$@")" >&9; return 0; fi
  if [ "$t" -lt 25 ]; then echo "!! [$(elapsed)s] skipped (time): $*" >&2; return 0; fi
  echo "+ [$(elapsed)s] $*" >&2
  timeout "$t" "$@"; local rc=$?
  [ $rc -eq 0 ] || echo "!! [$(elapsed)s] exit $rc for: $*" >&2; return $rc
}
L() { _budgeted python3 -m lmsys "$@"; }
X() { _budgeted "$@"; }
have_time() { [ -n "${DRY_RUN:-}" ] || [ $(( BUDGET - $(elapsed) )) -ge 25 ]; }
md() { printf '\n#### `lmsys %s`\n\n' "$*"; }
part() { [ "${PARTS:-}" = all ] || [[ " ${PARTS:-} " == *" $1 "* ]]; }
env_line() {
  X python3 -c "import torch, triton; print(torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__)"
}

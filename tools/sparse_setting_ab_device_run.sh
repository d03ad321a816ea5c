#!/usr/bin/env bash
# One GPU-machine call: the 64-token block-sparse rows (tools/probe_sparse_rows.py) under each
# of SETTINGS, ROUNDS rounds alternating them, then tools/probe_sparse_list_length.py (speed
# against list length, and on windowed lists) under each. A setting is LABEL:VAR=VALUE[,VAR=VALUE],
# the sm_90a measuring switches of sm90_fwd_launch_impl.h.
#   LIB=build/carry/x.so OUT=$OUT ROUNDS=2 \
#     SETTINGS="spread1:VIDATTN_SM90_WALK_SPREAD=1 spread4:VIDATTN_SM90_WALK_SPREAD=4" \
#     bash tools/sparse_setting_ab_device_run.sh
# PROBE_LISTS and PROBE_SHAPES (tools/probe_sparse_rows.py) pass through; PROBE_TIMEOUT: seconds per rows process.
set -uo pipefail
cd "$(dirname "$0")/.."
LIB=${LIB:?LIB=op library}
OUT=${OUT:-$(pwd)/sparse-setting-run}
SETTINGS=${SETTINGS:?SETTINGS=\"label:VAR=VALUE ...\"}
ROUNDS=${ROUNDS:-2}
STAGES=${STAGES:-"rows length"}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
cp "$LIB" python/vidattn/_vidattn_ops.so || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv | tee "$OUT/env.log"
# Runs "$@" with the setting's variables (LABEL:VAR=VALUE,VAR=VALUE) exported.
with_setting() {
  local spec=$1; shift
  local -a vars
  IFS=, read -ra vars <<<"${spec#*:}"
  env PROBE_LABEL="${spec%%:*}" "${vars[@]}" "$@"
}
if has rows; then
  for r in $(seq "$ROUNDS"); do
    for spec in $SETTINGS; do
      with_setting "$spec" timeout "${PROBE_TIMEOUT:-150}" python3 tools/probe_sparse_rows.py >>"$OUT/rows.log" 2>&1
    done
  done
  python3 - "$OUT/rows.log" <<'PY'
import sys
table = {}
for line in open(sys.argv[1]):
    if line.startswith("setting "):
        head, rest = line.split(": ", 1)
        row = rest.split(":")[0]
        table.setdefault(row, {}).setdefault(head[8:], []).append(line.split()[-2])
for row, cols in table.items():
    print(row, "|", " | ".join(f"{s}: {' / '.join(v)}" for s, v in cols.items()))
PY
fi
if has length; then
  for spec in $SETTINGS; do
    echo "== ${spec%%:*}"
    with_setting "$spec" timeout 200 python3 tools/probe_sparse_list_length.py \
      --out "$OUT/list_length_${spec%%:*}.txt" 2>&1 | tail -n 11
  done
fi

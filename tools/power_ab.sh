#!/usr/bin/env bash
# A/B of kernel switches at the power cap: tools/power_clocks.py (each workload back to back,
# median call time, SM clock and board power over the second half) once per setting and
# round, the settings alternating within each round.
#   OUT=dir ROUNDS=2 SECONDS_EACH=3 bash tools/power_ab.sh "-" "VIDATTN_SM90_CLUSTER=0"
# A setting is "-" (no variable) or space-separated VAR=value pairs. Writes
# $OUT/power_<setting index>_<round>.txt and prints them in order.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/power-ab}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
settings=("$@")
for ((r = 1; r <= ROUNDS; ++r)); do
  for i in "${!settings[@]}"; do
    s=${settings[$i]}
    [[ $s == "-" ]] && s=""
    # shellcheck disable=SC2086  # the setting is a list of VAR=value words
    env $s timeout "${AB_TIMEOUT:-120}" python3 tools/power_clocks.py \
      --seconds "${SECONDS_EACH:-3}" --out "$OUT/power_${i}_${r}.txt" >/dev/null 2>"$OUT/power_${i}_${r}.err" ||
      echo "setting $i round $r failed: $(tail -1 "$OUT/power_${i}_${r}.err")"
    echo "## setting '${settings[$i]}', round $r"
    cat "$OUT/power_${i}_${r}.txt" 2>/dev/null
  done
done

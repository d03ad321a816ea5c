#!/usr/bin/env bash
# One GPU-machine call that runs tools/sm90_varlen_probe.py cases with each of several op
# libraries, each case in its own process (a CUDA error is sticky), then the SANITIZE cases
# under compute-sanitizer memcheck (with line info: the build passes -lineinfo).
#   LIBS="main=build/carry/main.so ob=build/carry/ob.so" OUT=$OUT \
#   CASES="--lq 384,0,1 --lk 77,5,0 --causal 1;--lq 384 --lk 77 --batch 1 --heads 132,12" \
#   SANITIZE="ob:--lq 384,0,1 --lk 77,5,0 --causal 1" bash tools/sm90_probe_device_run.sh
# CASES and SANITIZE are ";"-separated; a SANITIZE entry is LIBNAME:ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
LIBS=${LIBS:?LIBS=NAME=LIB ...}
CASES=${CASES:?CASES=probe arguments, ";"-separated}
SANITIZE=${SANITIZE:-}
OUT=${OUT:-$(pwd)/probe-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.log"
use() {  # the library called $1
  for spec in $LIBS; do
    [[ ${spec%%=*} == "$1" ]] && { cp "${spec#*=}" python/vidattn/_vidattn_ops.so; return; }
  done
  echo "no library called $1" >&2
  return 1
}
IFS=';' read -r -a cases <<<"$CASES"
for spec in $LIBS; do
  name=${spec%%=*}
  use "$name" || exit 1
  for args in "${cases[@]}"; do
    echo "== $name: $args"
    # shellcheck disable=SC2086  # a list of arguments
    timeout 120 python3 tools/sm90_varlen_probe.py $args 2>&1 | tail -n 20
    echo "rc=${PIPESTATUS[0]}"
  done
done | tee "$OUT/probe.log"
IFS=';' read -r -a sanitize <<<"$SANITIZE"
i=0
for entry in "${sanitize[@]}"; do
  [[ -z $entry ]] && continue
  i=$((i + 1))
  use "${entry%%:*}" || exit 1
  echo "== memcheck ${entry}" | tee -a "$OUT/probe.log"
  # shellcheck disable=SC2086  # a list of arguments
  timeout 200 compute-sanitizer --tool memcheck --show-backtrace device --kernel-name kns=vidattn \
    python3 tools/sm90_varlen_probe.py ${entry#*:} >"$OUT/memcheck_$i.log" 2>&1
  echo "rc=$?" | tee -a "$OUT/probe.log"
  grep -E "Invalid|Illegal|Error|error|at 0x|SUMMARY|\.h:|\.cu:" "$OUT/memcheck_$i.log" | head -n 30 |
    tee -a "$OUT/probe.log"
done

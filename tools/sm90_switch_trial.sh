#!/usr/bin/env bash
# One GPU-machine call that tries a kernel switch: the GPU tests of the kernels it changes with
# the switch set, compute-sanitizer (memcheck, racecheck, synccheck) on tools/sm90_smoke.py
# with it, then tools/sm90_ab.sh's bench rows without and with it, alternating. Logs under $OUT.
#   SWITCH="VIDATTN_SM90_PINGPONG=0" PREBUILT_OPS=build/carry/_vidattn_ops.so OUT=/tmp/t \
#     bash tools/sm90_switch_trial.sh
# PYTEST_PATHS: the tests run with the switch (default: the block-sparse and VSA CUDA tests);
# BENCH_ARGS / ROUNDS: as tools/sm90_ab.sh takes them (default: 480p dense beside the
# block-sparse rows, three rounds); POWER_ARGS: power_clocks.py's workloads for the "power"
# stage (default: VSA and the 64-token kernel); STAGES: a subset of "pytest sanitizer ab power".
set -uo pipefail
cd "$(dirname "$0")/.."
: "${SWITCH:?SWITCH=VAR=value names the switch to try}"
OUT=${OUT:-$(pwd)/switch-trial}
STAGES=${STAGES:-"pytest sanitizer ab power"}
PYTEST_PATHS=${PYTEST_PATHS:-"tests/python/test_block_sparse_cuda.py tests/python/test_vsa_cuda.py"}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
if [ -n "${PREBUILT_OPS:-}" ]; then cp "$PREBUILT_OPS" python/vidattn/_vidattn_ops.so || exit 1; fi
export PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$SECONDS
log() { echo "[$((SECONDS - t0))s] $*"; }
if has pytest; then
  # shellcheck disable=SC2086  # SWITCH and PYTEST_PATHS are lists of words
  env $SWITCH timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest $PYTEST_PATHS -q -rfE \
    -p no:cacheprovider >"$OUT/pytest.log" 2>&1
  log "pytest ($SWITCH) rc=$?"; grep -E "passed|failed|error|FAILED" "$OUT/pytest.log" | tail -15
fi
if has sanitizer; then
  for tool in memcheck racecheck synccheck; do
    # shellcheck disable=SC2086
    env $SWITCH timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      --kernel-name kns=sm90 python3 tools/sm90_smoke.py >"$OUT/sanitizer_$tool.log" 2>&1
    log "sanitizer $tool ($SWITCH) rc=$?"; tail -2 "$OUT/sanitizer_$tool.log"
  done
fi
if has ab; then
  OUT=$OUT/ab ROUNDS=${ROUNDS:-3} BENCH_ARGS=${BENCH_ARGS:-"--shapes 1,39936,12,128"} \
    bash tools/sm90_ab.sh "-" "$SWITCH" | tee "$OUT/ab.txt"
  log "ab done"
fi
if has power; then
  OUT=$OUT/power ROUNDS=${POWER_ROUNDS:-2} AB_TOOL=power POWER_ARGS=${POWER_ARGS:-"--cases vsa,sparse"} \
    bash tools/sm90_ab.sh "-" "$SWITCH" | tee "$OUT/power.txt"
  log "power done"
fi

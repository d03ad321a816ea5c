#!/usr/bin/env bash
# One GPU-machine call for the sm_90a forward: build (90a only) or a prebuilt library, SASS
# check, the GPU tests, compute-sanitizer on tools/sm90_smoke.py, the dense / sparse bench, and
# A/B rounds of a kernel switch. Logs under $OUT.
#   OUT=... STAGES="build sass pytest sanitizer bench" bash tools/sm90_device_run.sh
#   SWITCH="VIDATTN_SM90_PINGPONG=0" PREBUILT_OPS=build/carry/_vidattn_ops.so OUT=/tmp/t \
#     STAGES="pytest sanitizer ab power" bash tools/sm90_device_run.sh
# SWITCH (VAR=value words): set for the tests and the sanitizers, and the "ab" / "power"
# stages run tools/sm90_ab.sh without and with it, alternating (default for those two stages:
# VIDATTN_SM90_PINGPONG=0). PREBUILT_OPS: a library to test instead of building one.
# PYTEST_FILES: the tests (default: the sm_90a and portable dense tests, or with SWITCH the
# block-sparse and VSA CUDA tests); BENCH_ARGS / ROUNDS: as tools/sm90_ab.sh takes them
# (default: 480p dense beside the block-sparse rows, three rounds); POWER_ARGS:
# power_clocks.py's workloads for "power" (default: VSA and the 64-token kernel).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/sm90-run}
SWITCH=${SWITCH:-}
STAGES=${STAGES:-"build sass pytest sanitizer bench ab"}
if [[ -n $SWITCH ]]; then
  PYTEST_FILES=${PYTEST_FILES:-"tests/python/test_block_sparse_cuda.py tests/python/test_vsa_cuda.py"}
else
  PYTEST_FILES=${PYTEST_FILES:-"tests/python/test_attention_sm90.py tests/python/test_attention_cuda.py"}
fi
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
if compgen -G "../../.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vidattn-site ../../.whl/nvidia_cutlass*.whl \
    && export PYTHONPATH=/tmp/vidattn-site
fi
export PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ CC=/usr/bin/gcc
t0=$SECONDS
log() { echo "[$((SECONDS - t0))s] $*"; }
OBJ=build/gpu/CMakeFiles/vidattn_cuda.dir/src/cuda/sm90
if [[ -n ${PREBUILT_OPS:-} ]]; then
  cp "$PREBUILT_OPS" python/vidattn/_vidattn_ops.so || exit 1
elif has build; then
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DVIDATTN_CUDA=ON \
    -DVIDATTN_BUILD_TORCH=ON -DVIDATTN_BUILD_TESTS=OFF -DVIDATTN_CUDA_TARGETS=90a \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  timeout 240 cmake --build build/gpu -j "$(nproc)" >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }
  cp build/gpu/_vidattn_ops.so python/vidattn/
  log "build done"
fi
if has sass; then
  for f in "$OBJ"/*.o; do
    printf '%s HGMMA=%s LDL/STL=%s\n' "$(basename "$f")" "$(cuobjdump -sass "$f" | grep -c HGMMA)" \
      "$(cuobjdump -sass "$f" | grep -cE 'LDL|STL')"
  done | tee "$OUT/sass.txt"
  cuobjdump -res-usage "$OBJ/sm90_fwd_bf16_hd128_dense.cu.o" 2>&1 | grep -A1 sm90 | head -4 | tee -a "$OUT/sass.txt"
fi
if has pytest; then
  # shellcheck disable=SC2086  # SWITCH and PYTEST_FILES are lists of words
  env $SWITCH timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest $PYTEST_FILES -q -rfE \
    -p no:cacheprovider >"$OUT/pytest.log" 2>&1
  log "pytest (${SWITCH:-no switch}) rc=$?"; grep -E "passed|failed|Error|FAILED" "$OUT/pytest.log" | tail -25
fi
if has sanitizer; then
  for tool in memcheck racecheck synccheck; do
    # shellcheck disable=SC2086  # SWITCH is a list of words
    env $SWITCH timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      --kernel-name kns=sm90 python3 tools/sm90_smoke.py >"$OUT/sanitizer_$tool.log" 2>&1
    log "sanitizer $tool (${SWITCH:-no switch}) rc=$?"; tail -2 "$OUT/sanitizer_$tool.log"
  done
fi
if has bench; then
  timeout "${BENCH_TIMEOUT:-120}" python3 tools/bench_dense_cuda.py "$OUT/bench_dense_cuda.json" >"$OUT/bench.log" 2>&1
  log "bench rc=$?"; tail -12 "$OUT/bench.log"
fi
AB_SWITCH=${SWITCH:-VIDATTN_SM90_PINGPONG=0}
if has ab; then
  OUT=$OUT/ab ROUNDS=${ROUNDS:-3} BENCH_ARGS=${BENCH_ARGS:-"--shapes 1,39936,12,128"} \
    bash tools/sm90_ab.sh "-" "$AB_SWITCH" | tee "$OUT/ab.txt"
  log "ab ($AB_SWITCH) done"
fi
if has power; then
  OUT=$OUT/power ROUNDS=${POWER_ROUNDS:-2} AB_TOOL=power POWER_ARGS=${POWER_ARGS:-"--cases vsa,sparse"} \
    bash tools/sm90_ab.sh "-" "$AB_SWITCH" | tee "$OUT/power.txt"
  log "power ($AB_SWITCH) done"
fi

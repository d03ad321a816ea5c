#!/usr/bin/env bash
# One GPU-machine call for the sm_90a forward: build (90a only), SASS check, the CUDA tests,
# compute-sanitizer on tools/sm90_smoke.py, the dense/sparse bench. Logs under $OUT.
#   OUT=... STAGES="build sass pytest sanitizer bench" bash tools/sm90_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/sm90-run}
STAGES=${STAGES:-"build sass pytest sanitizer bench ab"}
PYTEST_FILES=${PYTEST_FILES:-"tests/python/test_attention_sm90.py tests/python/test_attention_cuda.py"}
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
if has build; then
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
  timeout "${PYTEST_TIMEOUT:-170}" python3 -m pytest $PYTEST_FILES -q -rfE -p no:cacheprovider \
    >"$OUT/pytest.log" 2>&1
  log "pytest rc=$?"; grep -E "passed|failed|Error|FAILED" "$OUT/pytest.log" | tail -25
fi
if has sanitizer; then
  for tool in memcheck racecheck; do
    timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 3 --kernel-name kns=sm90 \
      python3 tools/sm90_smoke.py >"$OUT/sanitizer_$tool.log" 2>&1
    log "sanitizer $tool rc=$?"; tail -3 "$OUT/sanitizer_$tool.log"
  done
fi
if has bench; then
  timeout "${BENCH_TIMEOUT:-120}" python3 tools/bench_dense_cuda.py "$OUT/bench_dense_cuda.json" >"$OUT/bench.log" 2>&1
  log "bench rc=$?"; tail -12 "$OUT/bench.log"
fi
if has ab; then  # the same forward rows with an A/B switch ($AB_ENV, e.g. VIDATTN_SM90_PINGPONG=0)
  env BENCH_OURS_ONLY=1 ${AB_ENV:-VIDATTN_SM90_PINGPONG=0} timeout 60 python3 tools/bench_dense_cuda.py \
    "$OUT/bench_ab.json" >"$OUT/bench_ab.log" 2>&1
  log "bench (${AB_ENV:-VIDATTN_SM90_PINGPONG=0}) rc=$?"; grep -E '^ +\[' "$OUT/bench_ab.log"
fi

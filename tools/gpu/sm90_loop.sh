#!/usr/bin/env bash
# The Hopper kernel loop in one GPU-machine call: build for sm_90a only (or take a prebuilt
# library), a SASS check of the sm90 objects (HGMMA present, no local-memory spills), the GPU
# tests, compute-sanitizer (memcheck, racecheck, synccheck) on tools/gpu/sm90_smoke.py, and
# the dense / block-sparse kernel bench. Logs under $OUT.
#   OUT=... STAGES="build sass pytest sanitizer bench" bash tools/gpu/sm90_loop.sh
#   PREBUILT_OPS=build/carry/_vidattn_ops.so OUT=/tmp/t STAGES="pytest sanitizer" \
#     bash tools/gpu/sm90_loop.sh
# PREBUILT_OPS: a library to test instead of building one. PYTEST_FILES: the tests (default:
# the sm_90a and portable dense tests; tests/python for all); PYTEST_TIMEOUT (200 s).
# BENCH_ARGS: arguments of `python -m vidattn.bench dense` for the bench stage. To compare two
# libraries, tools/gpu/lib_ab.sh.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$(pwd)/sm90-run}
STAGES=${STAGES:-"build sass pytest sanitizer bench"}
PYTEST_FILES=${PYTEST_FILES:-"tests/python/test_attention_sm90.py tests/python/test_attention_cuda.py"}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
# The GPU machine has no network: the nvidia-cutlass wheel (the Hopper headers) comes in
# WHL_DIR (default .whl/, as for tools/gpu/gpu_runner.sh).
WHL_DIR=${WHL_DIR:-.whl}
if compgen -G "$WHL_DIR/nvidia_cutlass*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vidattn-site \
    "$WHL_DIR"/nvidia_cutlass*.whl && export PYTHONPATH=/tmp/vidattn-site
fi
export PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ CC=/usr/bin/gcc
t0=$SECONDS
log() { echo "[$((SECONDS - t0))s] $*"; }
if [[ -n ${PREBUILT_OPS:-} ]]; then
  cp "$PREBUILT_OPS" python/vidattn/_vidattn_ops.so || exit 1
elif has build; then
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DVIDATTN_CUDA=ON \
    -DVIDATTN_BUILD_TORCH=ON -DVIDATTN_BUILD_TESTS=OFF -DVIDATTN_TESTING=ON \
    -DVIDATTN_CUDA_TARGETS=90a -DPython_EXECUTABLE="$(command -v python3)" \
    >"$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  timeout 240 cmake --build build/gpu -j "$(nproc)" >"$OUT/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; }
  cp build/gpu/_vidattn_ops.so python/vidattn/
  log "build done"
fi
if has sass; then
  # The objects of the sm90 sources, wherever the source tree keeps them.
  mapfile -t objs < <(find build/gpu -path '*sm90*' -name '*.cu.o' | sort)
  for f in "${objs[@]}"; do
    printf '%s HGMMA=%s LDL/STL=%s\n' "$(basename "$f")" "$(cuobjdump -sass "$f" | grep -c HGMMA)" \
      "$(cuobjdump -sass "$f" | grep -cE 'LDL|STL')"
  done | tee "$OUT/sass.txt"
  # Registers and shared memory of the bf16 D = 128 dense instance (either naming scheme).
  dense=$(printf '%s\n' "${objs[@]}" | grep -E 'bf16_hd128_dense\.|hdim128_bf16_dense_' | head -n 1)
  [[ -n $dense ]] && cuobjdump -res-usage "$dense" 2>&1 | grep -A1 sm90 | head -4 | tee -a "$OUT/sass.txt"
fi
if has pytest; then
  # shellcheck disable=SC2086  # a list of files
  timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest $PYTEST_FILES -q -rfE \
    -p no:cacheprovider >"$OUT/pytest.log" 2>&1
  log "pytest rc=$?"; grep -E "passed|failed|Error|FAILED" "$OUT/pytest.log" | tail -25
fi
if has sanitizer; then
  for tool in memcheck racecheck synccheck; do
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      --kernel-name kns=sm90 python3 tools/gpu/sm90_smoke.py >"$OUT/sanitizer_$tool.log" 2>&1
    log "sanitizer $tool rc=$?"; tail -2 "$OUT/sanitizer_$tool.log"
  done
fi
if has bench; then
  # shellcheck disable=SC2086  # a list of arguments
  timeout "${BENCH_TIMEOUT:-120}" python3 -m vidattn.bench dense --out "$OUT/bench_dense.json" \
    ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  log "bench rc=$?"; tail -12 "$OUT/bench.log"
fi

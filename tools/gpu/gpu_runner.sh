#!/usr/bin/env bash
# GPU runner: on a machine with an NVIDIA GPU, python3 with a CUDA torch, nvcc, cmake and
# ninja (no network needed), builds vidattn, runs the whole pytest suite and the C++ tests on
# it, compute-sanitizer (memcheck, racecheck) on a small forward + backward, and the
# benchmarks; leaves logs and JSON under $OUT (default ./gpu-run) and prints a summary.
#
#   OUT=/tmp/run bash tools/gpu/gpu_runner.sh            # everything
#   STAGES="build pytest" bash tools/gpu/gpu_runner.sh   # a subset of the stages below
#   PYTEST_ARGS="-k cuda" bash tools/gpu/gpu_runner.sh   # extra pytest arguments
#   CMAKE_ARGS="-DVIDATTN_CUDA_TARGETS=90a" bash tools/gpu/gpu_runner.sh   # extra configure arguments
#   VIDATTN_GIT_COMMIT=<hash> names the commit in the bench JSON when the tree has no .git
#   BENCH_ARGS="--shapes gpu-suite --directions fwd --out $OUT/suite.json" bash tools/gpu/gpu_runner.sh
#   PREBUILT_OPS=build/carry/_vidattn_ops.so ...   # skip the build; PYTEST_TIMEOUT, BENCH_TIMEOUT (s)
#   PYTEST_PATHS="tests/python/test_a.py tests/python/test_b.py"   # instead of all of tests/python
#   FASTVIDEO_DIR=../fastvideo BENCH_ARGS="--shapes gpu-suite" ...   # FastVideo's Triton peers
#     (a folder holding fastvideo_kernel/, made by tools/peers/fastvideo_peer.sh)
# Stages (STAGES, default "build pytest cpp sanitizer bench"); the benchmarks are modes of
# python -m vidattn.bench (bench/README.md):
#   build        configure and build build/gpu (CMAKE_ARGS), the op library into python/vidattn/
#   pytest       tests/python (PYTEST_PATHS, PYTEST_ARGS)
#   cpp          the C++ tests, when GoogleTest was found
#   sanitizer    compute-sanitizer memcheck and racecheck on tools/gpu/cuda_smoke.py
#   bench        python -m vidattn.bench (the case runner; BENCH_ARGS)
#   bench_dense  python -m vidattn.bench dense            -> $OUT/dense.json
#   sweep        python -m vidattn.bench dense --sweep    -> SWEEP_OUT ($OUT/dense-sweep.json)
#   bench_sparse python -m vidattn.bench block-sparse     -> $OUT/block-sparse.json
#   profile      Nsight Compute on tools/profile/profile_sm90.py -> $OUT/sm90_profile.txt, stalls
#   distributed  python -m vidattn.bench distributed on 2 GPUs (DIST_ARGS, default --check)
#   alltoall     python -m vidattn.bench alltoall on 2 GPUs, one run per ALLTOALL_ENVS setting
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$(pwd)/gpu-run}
STAGES=${STAGES:-"build pytest cpp sanitizer bench"}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
LOGS=$OUT/logs
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH}
declare -a SUMMARY=()
# The GPU machine has no network: wheels carried in .whl/ (nvidia-cutlass for the Hopper
# headers, fastvideo-kernel for the bench's peer) install into a private site folder.
if compgen -G ".whl/*.whl" >/dev/null; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/vidattn-site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/vidattn-site
fi
if [ -n "${FASTVIDEO_DIR:-}" ]; then
  export PYTHONPATH=$PYTHONPATH:$(cd "$FASTVIDEO_DIR" && pwd)
fi
has() { [[ " $STAGES " == *" $1 "* ]]; }
# stage NAME TIMEOUT_S CMD...: runs CMD with a time limit, logs to $LOGS/NAME.log.
stage() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  SUMMARY+=("$(printf '%-22s rc=%-4s %5ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$LOGS/$name.log" | cut -c1-90)")")
  return $rc
}

# The distribution's g++ by default: the image's CXX (/opt/gcc/bin/g++, a wrapper whose
# library path holds a static libstdc++) linked libstdc++ into the op library, and that second
# copy beside torch's crashed formatting an integer into an error message. RUNNER_CXX=...
# picks another compiler.
RUNNER_CXX=${RUNNER_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || echo "${CXX:-c++}")}
export CXX=$RUNNER_CXX CUDAHOSTCXX=$RUNNER_CXX
if [ "$RUNNER_CXX" = /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CC=/usr/bin/gcc; fi
{
  echo "CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-}"; ${CXX:-c++} --version | head -n 1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  nvcc --version | tail -n 2
  $PYTHON -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'
  cmake --version | head -n 1
} >"$LOGS/env.log" 2>&1
cat "$LOGS/env.log"

BUILD_OK=1
# PREBUILT_OPS=path/_vidattn_ops.so: an op library built elsewhere for this torch (e.g. on a
# CPU machine with -DVIDATTN_CUDA=ON -DVIDATTN_USE_BLAS=OFF) instead of the build stage.
if [ -n "${PREBUILT_OPS:-}" ]; then
  STAGES=${STAGES//build/}
  cp "$PREBUILT_OPS" python/vidattn/_vidattn_ops.so || BUILD_OK=0
fi
if has build; then
  tests_flag=OFF
  if [ -n "$(find /usr /opt -name GTestConfig.cmake -print -quit 2>/dev/null)" ]; then tests_flag=ON; fi
  stage configure 120 cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DVIDATTN_CUDA=ON -DVIDATTN_BUILD_TORCH=ON -DVIDATTN_BUILD_TESTS=$tests_flag -DVIDATTN_TESTING=ON \
    -DPython_EXECUTABLE="$(command -v $PYTHON)" ${CMAKE_ARGS:-} || BUILD_OK=0
  if [ $BUILD_OK = 1 ]; then
    stage build 300 cmake --build build/gpu -j "$JOBS" && cp build/gpu/_vidattn_ops.so python/vidattn/ || BUILD_OK=0
  fi
  if [ $BUILD_OK = 1 ] && ! ldd python/vidattn/_vidattn_ops.so | grep -q 'libstdc++'; then
    echo "WARNING: _vidattn_ops.so does not load the shared libstdc++ (static copy? compiler: $CXX)" | tee -a "$LOGS/env.log"
  fi
fi

if [ $BUILD_OK = 1 ]; then
  if has pytest; then
    stage pytest ${PYTEST_TIMEOUT:-300} $PYTHON -m pytest ${PYTEST_PATHS:-tests/python} -q -rfE -p no:cacheprovider \
      --junitxml="$OUT/pytest.xml" ${PYTEST_ARGS:-}
  fi
  if has cpp && [ -x build/gpu/tests/cpp/vidattn_cpp_tests ]; then
    stage cpp_tests 120 build/gpu/tests/cpp/vidattn_cpp_tests --gtest_brief=1
  fi
  if has sanitizer; then
    for tool in memcheck racecheck; do
      stage "sanitizer_$tool" 150 compute-sanitizer --tool "$tool" --error-exitcode 3 \
        --kernel-name kns=vidattn $PYTHON tools/gpu/cuda_smoke.py
    done
  fi
  if has bench; then
    if [ -d python/vidattn/bench ]; then
      stage vidattn_bench ${BENCH_TIMEOUT:-300} $PYTHON -m vidattn.bench --no-progress ${BENCH_ARGS:-}
    fi
  fi
  if has distributed; then
    # Sequence-parallel layer on 2 GPUs against 1 (parity, compile, efficiency); NVLink
    # multicast off (the lent machines do not support it).
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        stage distributed ${DIST_TIMEOUT:-240} $PYTHON -m torch.distributed.run --nproc_per_node 2 \
        -m vidattn.bench distributed ${DIST_ARGS:---check} --out "$OUT/distributed.json"
    else
      echo "=== distributed: skipped (needs 2 GPUs)"
    fi
  fi
  if has alltoall && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    # NCCL all-to-all bandwidth alone and beside a matmul, one run per NCCL setting
    # (ALLTOALL_ENVS: ';'-separated settings, 'default' for none); the first run logs NCCL's
    # transport choice (NCCL_DEBUG=INFO) to alltoall_nccl_info.log.
    i=0
    IFS=';' read -ra settings <<<"${ALLTOALL_ENVS:-default}"
    for setting in "${settings[@]}"; do
      extra=(); [ "$setting" != default ] && read -ra extra <<<"$setting"
      debug=(); [ $i = 0 ] && debug=(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,TUNING \
        NCCL_DEBUG_FILE="$LOGS/alltoall_nccl_info.%h.%p.log")
      stage "alltoall_$i" 120 env NCCL_NVLS_ENABLE=0 "${debug[@]}" "${extra[@]}" \
        $PYTHON -m torch.distributed.run --nproc_per_node 2 -m vidattn.bench alltoall \
        --label "$setting" --out "$OUT/alltoall_$i.json"
      i=$((i + 1))
    done
    cat "$LOGS"/alltoall_nccl_info.*.log 2>/dev/null | grep -E "via|Channel|NCCL version|P2P|proto" \
      | sort | uniq -c | sort -rn | head -60 >"$OUT/alltoall_nccl_info.txt"
  fi
  if has bench_dense; then
    stage bench_dense 200 $PYTHON -m vidattn.bench dense --out "$OUT/dense.json"
  fi
  if has sweep; then  # the forward sweep across shapes against cuDNN
    stage sweep 120 $PYTHON -m vidattn.bench dense --sweep --out "${SWEEP_OUT:-$OUT/dense-sweep.json}"
  fi
  if has bench_sparse; then
    stage bench_sparse 200 $PYTHON -m vidattn.bench block-sparse --out "$OUT/block-sparse.json"
  fi
  if has profile; then
    # Nsight Compute on one launch of the dense and the block-sparse sm_90a forward.
    stage profile 300 ncu --profile-from-start off --set full --kernel-name regex:sm90 \
      -o "$LOGS/sm90_profile" $PYTHON tools/profile/profile_sm90.py
    ncu --import "$LOGS/sm90_profile.ncu-rep" --page details >"$OUT/sm90_profile.txt" 2>&1
    # Warp stall reasons per kernel (the details page shows only their sum).
    ncu --import "$LOGS/sm90_profile.ncu-rep" --page raw --csv 2>/dev/null \
      | python3 tools/profile/ncu_stalls.py >"$OUT/sm90_stalls.txt" 2>&1
    cp "$LOGS/sm90_profile.ncu-rep" "$OUT/" 2>/dev/null
  fi
fi

tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
echo
echo "================ summary ================"
printf '%s\n' "${SUMMARY[@]}"

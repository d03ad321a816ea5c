#!/usr/bin/env bash
# Builds the op library (_vidattn_ops.so, CUDA 80 + 90a, test hooks on) of a source tree on
# the GPU machine, with the compiler choice of gpu_runner.sh: for this tree, or for a baseline
# tree of another commit carried beside it (git archive <commit> | tar -x -C .xfer/base), so
# that tools/gpu/lib_ab.sh and tools/profile/sass_compare.py compare the two.
#
#   bash tools/gpu/build_ops.sh SRC_DIR BUILD_DIR [JOBS]     -> BUILD_DIR/_vidattn_ops.so
#
# The CUTLASS headers come from the nvidia-cutlass wheel on PYTHONPATH (carried in .whl/).
set -euo pipefail
SRC=${1:?source tree}
BUILD=${2:?build directory}
JOBS=${3:-$(nproc)}
PYTHON=${PYTHON:-python3}
CXX_DEFAULT=$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || echo "${CXX:-c++}")
export CXX=${RUNNER_CXX:-$CXX_DEFAULT} CUDAHOSTCXX=${RUNNER_CXX:-$CXX_DEFAULT}
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DVIDATTN_CUDA=ON \
  -DVIDATTN_BUILD_TORCH=ON -DVIDATTN_BUILD_TESTS=OFF -DVIDATTN_TESTING=ON \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" ${CMAKE_ARGS:-}
cmake --build "$BUILD" -j "$JOBS"
ls -la "$BUILD/_vidattn_ops.so"

#!/usr/bin/env bash
# Sets everything up (tools/setup.sh, idempotent) and runs every test: the C++ suite
# (GoogleTest through CTest), the find_package example against an installed core, and the
# Python suite (pytest). GPU tests skip themselves where there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh

jobs=$(nproc)
echo "== C++ tests (GoogleTest)"
cmake -S . -B build/cpp-tests -G Ninja -DCMAKE_BUILD_TYPE=Release -DVIDATTN_BUILD_TESTS=ON \
  -DVIDATTN_CUDA=OFF -DCMAKE_MAKE_PROGRAM="$(pwd)/.venv/bin/ninja" \
  -DPython_EXECUTABLE="$(pwd)/.venv/bin/python" >/dev/null
cmake --build build/cpp-tests -j "$jobs"
ctest --test-dir build/cpp-tests --output-on-failure -j "$jobs"

echo "== find_package(vidattn) example against an installed core"
cmake --install build/cpp-tests --prefix build/install >/dev/null
cmake -S examples/find_package -B build/example -G Ninja -DCMAKE_PREFIX_PATH="$(pwd)/build/install" \
  -DCMAKE_MAKE_PROGRAM="$(pwd)/.venv/bin/ninja" >/dev/null
cmake --build build/example >/dev/null
./build/example/vidattn_example

echo "== Python tests (pytest)"
.venv/bin/python -m pytest tests/python -q "$@"

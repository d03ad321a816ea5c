#!/usr/bin/env bash
# Developer loop without reinstalling: builds the core, the C++ tests and the op library in
# build/dev (incremental, ninja) and drops the op library into python/vidattn/, so that
# `PYTHONPATH=python .venv/bin/python -m pytest` runs this checkout's code.
# Needs the .venv of tools/setup.sh (pass PYTHON=... to use another interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(pwd)/.venv/bin/python}
cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DVIDATTN_BUILD_TESTS=ON \
  -DVIDATTN_BUILD_TORCH=ON -DVIDATTN_TESTING=ON -DPython_EXECUTABLE="$PYTHON" ${VIDATTN_CMAKE_ARGS:-} >/dev/null
cmake --build build/dev
cp build/dev/_vidattn_ops.so python/vidattn/

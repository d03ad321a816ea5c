#!/usr/bin/env bash
# Sets up a fresh machine for vidattn: system packages (Debian), the virtual environment at
# .venv with the pinned Python packages, and vidattn itself built into it. Idempotent: a
# second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v g++ >/dev/null || need_apt+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
ls /usr/lib/*/openblas-openmp/libopenblas.so >/dev/null 2>&1 || need_apt+=(libopenblas-openmp-dev)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.vidattn-requirements
if ! cmp -s requirements/dev.txt "$stamp"; then
  echo "setup: installing Python packages (requirements/dev.txt)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements/dev.txt
  cp requirements/dev.txt "$stamp"
fi

echo "setup: building vidattn into .venv"
# VIDATTN_TESTING: the test-only hooks the test suites query (a plain pip install leaves them out).
defines=(-C cmake.define.VIDATTN_TESTING=ON)
# VIDATTN_CUDA_TARGETS (e.g. "90a"), when set, narrows the GPU targets compiled (CMake's default:
# "80;90a"); .ci/run sets it to keep the CUDA build within CI's time.
if [ -n "${VIDATTN_CUDA_TARGETS:-}" ]; then
  echo "setup: CUDA targets ${VIDATTN_CUDA_TARGETS} (VIDATTN_CUDA_TARGETS)"
  defines+=(-C "cmake.define.VIDATTN_CUDA_TARGETS=${VIDATTN_CUDA_TARGETS}")
fi
.venv/bin/python -m pip install -q --no-build-isolation --no-deps "${defines[@]}" .
.venv/bin/python -c 'import vidattn; print("setup: vidattn", vidattn.__version__, "ready in .venv")'

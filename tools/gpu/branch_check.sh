#!/usr/bin/env bash
# One GPU-machine call for a branch whose op library is built nowhere else yet: builds this
# tree's library (tools/gpu/build_ops.sh, CUTLASS from the carried .whl wheels), then runs the
# named test files and bench runs with it. Run from the tree (e.g. a git archive of the
# branch carried to the GPU machine and extracted there, with .whl linked beside it).
#
#   OUT=$OUT PYTEST_PATHS="tests/python/test_a.py ..." \
#     BENCH="dense --shapes 1,39936,12,128; dense --head-dims --fwd-vs-cudnn" \
#     CMAKE_ARGS="-DVIDATTN_CUDA_TARGETS=90a" bash tools/gpu/branch_check.sh
#
# BENCH: bench runs separated by ';' (bench.json, bench-2.json, ...). PYTEST_TIMEOUT (s, 240),
# BENCH_TIMEOUT (s, 150, per run), JOBS (nproc). Prints the build time, the pytest summary and
# failures, and the bench tables; logs and the bench JSON land in OUT.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$(pwd)/branch-check}
mkdir -p "$OUT"
t0=$SECONDS
source tools/gpu/ops_setup.sh
install_carried_wheels
build_ops build/branch || exit 1
cp build/branch/_vidattn_ops.so python/vidattn/
export PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${PYTEST_PATHS:-}" ]; then
  timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest $PYTEST_PATHS -q -rfE -p no:cacheprovider \
    >"$OUT/pytest.log" 2>&1
  echo "pytest rc=$? at $((SECONDS - t0))s: $(tail -n 1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 30
fi
n=0
IFS=';' read -ra benches <<<"${BENCH:-}"
for bench in "${benches[@]}"; do
  [ -n "${bench// /}" ] || continue
  n=$((n + 1))
  suffix=$([ "$n" = 1 ] && echo "" || echo "-$n")
  timeout "${BENCH_TIMEOUT:-150}" python3 -m vidattn.bench $bench --out "$OUT/bench$suffix.json" \
    >"$OUT/bench$suffix.log" 2>&1
  echo "bench$suffix ($bench) rc=$? at $((SECONDS - t0))s"
  grep -v '^{' "$OUT/bench$suffix.log" | tail -n 30
done

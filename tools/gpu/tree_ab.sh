#!/usr/bin/env bash
# One GPU-machine call that checks a candidate op library against a baseline source tree:
# builds the baseline (tools/gpu/build_ops.sh) while the whole pytest suite runs on the
# candidate, compares the two libraries' SASS body for body (tools/profile/sass_compare.py
# --by-body), then runs tools/gpu/lib_ab.sh's measurement stages with both, alternating.
#
#   NEW=/tmp/new.so BASE_SRC=.xfer/base OUT=$OUT AB_STAGES="dense sparse" ROUNDS=2 \
#     bash tools/gpu/tree_ab.sh
#
# NEW: the candidate library (built for this tree, VIDATTN_TESTING=ON). BASE_SRC: the baseline
# tree (git archive <commit> src include torch cmake CMakeLists.txt tests/cpp | tar -x -C DIR).
# PYTEST_TIMEOUT (s, 300), AB_STAGES (lib_ab.sh's STAGES, "dense sparse"). The CUTLASS headers
# come from the nvidia-cutlass wheel on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
NEW=${NEW:?NEW=candidate library}
BASE_SRC=${BASE_SRC:?BASE_SRC=baseline source tree}
OUT=${OUT:-$(pwd)/tree-ab-run}
mkdir -p "$OUT"
t0=$SECONDS
(bash tools/gpu/build_ops.sh "$BASE_SRC" build/base "${BASE_JOBS:-10}" >"$OUT/build_base.log" 2>&1
 echo "baseline build rc=$? at $((SECONDS - t0))s" >>"$OUT/build_base.log") &
cp "$NEW" python/vidattn/_vidattn_ops.so
PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH} timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest \
  tests/python -q -rfE -p no:cacheprovider >"$OUT/pytest.log" 2>&1
echo "pytest rc=$? at $((SECONDS - t0))s: $(tail -n 1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20
wait
tail -n 1 "$OUT/build_base.log"
[ -f build/base/_vidattn_ops.so ] || exit 1
for arch in sm_90a sm_80; do
  python3 tools/profile/sass_compare.py --by-body build/base/_vidattn_ops.so "$NEW" --arch "$arch" \
    >"$OUT/sass_$arch.txt" 2>&1
  echo "sass $arch: $(head -n 2 "$OUT/sass_$arch.txt" | tr '\n' ' ')"
done
NEW=$NEW OLD=build/base/_vidattn_ops.so OUT=$OUT STAGES="${AB_STAGES:-dense sparse}" \
  bash tools/gpu/lib_ab.sh
echo "tree_ab done at $((SECONDS - t0))s"

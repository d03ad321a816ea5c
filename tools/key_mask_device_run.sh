#!/usr/bin/env bash
# Padding masks on an sm_90 GPU in one call: the mask tests, compute-sanitizer (memcheck,
# racecheck) on tools/sm90_smoke.py, then tools/bench_key_mask_cuda.py with the packed path on
# and off (VIDATTN_SM90_PACK_PADDING), alternating within each of ROUNDS rounds. Logs under $OUT.
#   PREBUILT_OPS=build/carry/_vidattn_ops.so OUT=$OUT ROUNDS=2 bash tools/key_mask_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/key-mask-run}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${PREBUILT_OPS:-}" ]; then cp "$PREBUILT_OPS" python/vidattn/_vidattn_ops.so || exit 1; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv | tee "$OUT/env.log"

timeout 400 python3 -m pytest -q -rfE -p no:cacheprovider tests/python/test_attention_sm90.py \
  "tests/python/test_attention_cuda.py" -k "${PYTEST_K:-sm90 or mask or padding}" \
  >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?: $(tail -n 1 "$OUT/pytest.log")"
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 3 --kernel-name kns=vidattn \
    python3 tools/sm90_smoke.py >"$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool rc=$?: $(grep -E 'SUMMARY|sm90_smoke' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
done
for ((r = 1; r <= ROUNDS; ++r)); do
  for setting in 1 0; do
    echo "## VIDATTN_SM90_PACK_PADDING=$setting, round $r"
    VIDATTN_SM90_PACK_PADDING=$setting timeout 300 python3 tools/bench_key_mask_cuda.py \
      --grids "${GRIDS:-480p,720p}" 2>&1 | tee "$OUT/bench_${setting}_${r}.log"
  done
done

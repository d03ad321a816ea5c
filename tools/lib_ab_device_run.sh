#!/usr/bin/env bash
# One GPU-machine call that checks candidate op libraries and measures them against a
# baseline: the sm_90a tests and compute-sanitizer (memcheck, racecheck) on
# tools/sm90_smoke.py with each candidate, then library A/B runs (tools/lib_ab.sh,
# alternating within each round) of
#  * dense forward against cuDNN (tools/bench_dense_cuda.py --fwd-vs-cudnn, DENSE_SHAPES),
#  * the sm_90a block-sparse rows (bench_dense_cuda.py, ours only, one dense shape first),
#  * the whole VSA forward (tools/vsa_lib_ab.sh, VSA_ARGS; default Wan 480p; several
#    argument sets separated by ";").
# SPARSE_ROWS (bench_dense_cuda.py's BENCH_SPARSE) picks the block-sparse rows.
#   NEW=build/carry/new.so OLD=build/carry/old.so OUT=$OUT ROUNDS=2 STAGES="pytest sanitizer
#     dense sparse vsa" bash tools/lib_ab_device_run.sh
# NEW may name several candidates, "a=x.so b=y.so" (a bare path is called "new").
# Logs under $OUT; a summary on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=${NEW:?NEW=candidate library, or NAME=LIB ...}
OLD=${OLD:?OLD=baseline library}
OUT=${OUT:-$(pwd)/lib-ab-run}
STAGES=${STAGES:-"pytest sanitizer dense sparse vsa"}
PYTEST_FILES=${PYTEST_FILES:-"tests/python/test_attention_sm90.py tests/python/test_block_sparse_cuda.py tests/python/test_vsa_cuda.py"}
DENSE_SHAPES=${DENSE_SHAPES:-"1,32760:512,12,128 1,32760:257,12,128 1,39936,12,128 1,32768,12,128 2,16384,32,64"}
VSA_ARGS=${VSA_ARGS:-"--iters 10"}
export ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH}
candidates=()
for spec in $NEW; do [[ $spec == *=* ]] && candidates+=("$spec") || candidates+=("new=$spec"); done
t0=$SECONDS
log() { echo "[$((SECONDS - t0))s] $*"; }
# One line per row: each library's TFLOP/s per round (cuDNN's in brackets), read from
# lib_ab.sh's log of the bench's JSON lines.
summarize() {
  python3 - "$1" <<'EOF'
import json, sys
name, table = None, {}
for line in open(sys.argv[1]):
    if line.startswith("== "):
        name = line[3:].split(",")[0]
    elif line.startswith("{") and name:
        row = json.loads(line)
        rate = row.get("vidattn_fwd", row.get("sparse_fwd"))
        if rate is None:
            continue
        key = " ".join(str(row[k]) for k in ("shape", "kv_len", "tile", "sparsity") if k in row)
        cell = f"{rate:.1f}" + (f" [{row['cudnn_fwd']:.1f}]" if "cudnn_fwd" in row else "")
        table.setdefault(key, {}).setdefault(name, []).append(cell)
    elif "failed" in line:
        print(line.strip())
for key, libs in table.items():
    print(key, "|", " | ".join(f"{n}: {' / '.join(c)}" for n, c in libs.items()))
EOF
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv | tee "$OUT/env.log"
for spec in "${candidates[@]}"; do
  name=${spec%%=*}
  cp "${spec#*=}" python/vidattn/_vidattn_ops.so || exit 1
  if has pytest; then
    # shellcheck disable=SC2086  # a list of files
    timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q -rfE -p no:cacheprovider $PYTEST_FILES \
      >"$OUT/pytest_$name.log" 2>&1
    log "$name: pytest rc=$?: $(tail -n 1 "$OUT/pytest_$name.log")"
  fi
  if has sanitizer; then
    for tool in memcheck racecheck; do
      timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 3 --kernel-name kns=vidattn \
        python3 tools/sm90_smoke.py >"$OUT/sanitizer_${tool}_$name.log" 2>&1
      log "$name: $tool rc=$?: $(grep -E 'SUMMARY' "$OUT/sanitizer_${tool}_$name.log" | tr '\n' ' ')"
    done
  fi
done
if has dense; then
  log "dense forward against cuDNN"
  # shellcheck disable=SC2086  # a list of shapes
  bash tools/lib_ab.sh tools/bench_dense_cuda.py "${candidates[@]}" old="$OLD" -- "$OUT/dense.json" \
    --fwd-vs-cudnn --shapes $DENSE_SHAPES >"$OUT/dense_ab.log" 2>&1
  summarize "$OUT/dense_ab.log"
fi
if has sparse; then
  log "block-sparse rows (ours only)"
  BENCH_OURS_ONLY=1 BENCH_SPARSE=${SPARSE_ROWS:-} bash tools/lib_ab.sh tools/bench_dense_cuda.py \
    "${candidates[@]}" old="$OLD" -- \
    "$OUT/sparse.json" --shapes 1,39936,12,128 >"$OUT/sparse_ab.log" 2>&1
  summarize "$OUT/sparse_ab.log"
fi
if has vsa; then
  log "whole VSA forward"
  IFS=';' read -r -a vsa_cases <<<"$VSA_ARGS"
  for args in "${vsa_cases[@]}"; do
    # shellcheck disable=SC2086  # a list of arguments
    bash tools/vsa_lib_ab.sh "${candidates[@]}" old="$OLD" -- $args 2>&1 | tee -a "$OUT/vsa_ab.log"
  done
fi
log "done"

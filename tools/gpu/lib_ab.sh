#!/usr/bin/env bash
# A/B of op libraries in one GPU-machine call: candidate libraries against a baseline.
# First the checks on each candidate: the CUDA tests (PYTEST_FILES) and compute-sanitizer
# (memcheck, racecheck) on tools/gpu/sm90_smoke.py. Then the measurements, each run once per
# library and round with the libraries alternating within each round, so that clock and
# thermal drift reach all of them alike:
#  * dense:  the dense forward against cuDNN (python -m vidattn.bench dense --fwd-vs-cudnn,
#            DENSE_SHAPES), one line per row with each library's TFLOP/s per round;
#  * sparse: the sm_90a block-sparse rows (the dense mode, ours only, one dense shape first;
#            SPARSE_ROWS "B,S,H,D,tile,sparsity ..." picks the rows);
#  * bwd:    the backward (python -m vidattn.bench dense on BWD_SHAPES: deterministic and
#            fused-dQ backward, cuDNN's), then the block-sparse op at Wan 480p (bench
#            block-sparse: its forward and backward, our dense ones);
#  * vsa:    the whole VSA forward's kernel time (tools/profile/profile_vsa.py, VSA_ARGS,
#            default Wan 480p; several argument sets separated by ";");
#  * cmd:    any command, AB_CMD (e.g. AB_CMD="python3 -m vidattn.bench rope"), its output
#            filtered by AB_FILTER (grep -E) and cut to AB_LINES lines.
#
#   NEW=build/carry/new.so OLD=build/carry/old.so OUT=$OUT ROUNDS=2 \
#     STAGES="pytest sanitizer dense sparse vsa" bash tools/gpu/lib_ab.sh
#
# NEW may name several candidates, "a=x.so b=y.so" (a bare path is called "new"); OLD is the
# baseline ("old"). A library may come with its own Python package, LIB@DIR (DIR holds
# vidattn/; default this tree's python/): a library built from another commit may lack an op
# the newer Python calls. Each library runs from a private copy of its package, so the tree's
# python/vidattn is never overwritten. AB_TIMEOUT: seconds per measured run (120).
# Logs under $OUT; a summary on stdout. For kernels that should not have changed at all,
# tools/profile/sass_compare.py answers without a GPU.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
NEW=${NEW:?NEW=candidate library, or NAME=LIB[@DIR] ...}
OLD=${OLD:?OLD=baseline library (LIB[@DIR])}
OUT=${OUT:-$(pwd)/lib-ab-run}
STAGES=${STAGES:-"pytest sanitizer dense sparse vsa"}
PYTEST_FILES=${PYTEST_FILES:-"tests/python/test_attention_sm90.py tests/python/test_block_sparse_cuda.py tests/python/test_vsa_cuda.py"}
DENSE_SHAPES=${DENSE_SHAPES:-"1,32760:512,12,128 1,32760:257,12,128 1,39936,12,128 1,32768,12,128 2,16384,32,64"}
BWD_SHAPES=${BWD_SHAPES:-"1,39936,12,128 2,16384,32,64 1,16384,12,128,causal"}
VSA_ARGS=${VSA_ARGS:-"--iters 10"}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
t0=$SECONDS
log() { echo "[$((SECONDS - t0))s] $*"; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Every library as NAME, with its package copied to $WORK/NAME (the candidates first).
names=()
add_library() {  # NAME=LIB[@DIR]
  local spec=$1 name lib pydir rest
  name=${spec%%=*}; rest=${spec#*=}
  lib=${rest%%@*}; pydir=$(pwd)/python
  [[ $rest == *@* ]] && pydir=${rest#*@}
  if [[ $name == "$spec" || ! -f $lib || ! -d $pydir/vidattn ]]; then
    echo "lib_ab: expected NAME=LIB.so[@PYTHON_DIR] with an existing library and" \
      "DIR/vidattn, got '$spec'" >&2
    exit 2
  fi
  mkdir -p "$WORK/$name"
  cp -r "$pydir/vidattn" "$WORK/$name/"
  rm -f "$WORK/$name"/vidattn/*.so
  cp "$lib" "$WORK/$name/vidattn/_vidattn_ops.so"
  names+=("$name")
}
candidates=()
for spec in $NEW; do
  [[ $spec == *=* ]] || spec="new=$spec"
  add_library "$spec"
  candidates+=("${spec%%=*}")
done
add_library "old=$OLD"

# rounds CMD...: CMD once per library and round, alternating, under each library's package.
rounds() {
  local r name
  for ((r = 1; r <= ROUNDS; ++r)); do
    for name in "${names[@]}"; do
      echo "== $name, round $r"
      PYTHONPATH="$WORK/$name" timeout "${AB_TIMEOUT:-120}" "$@" 2>&1 |
        grep -E "${AB_FILTER:-}" | head -n "${AB_LINES:--0}" || echo "$name round $r failed"
    done
  done
}

# One line per row: each library's TFLOP/s per round (cuDNN's in brackets), read from the
# dense mode's JSON lines in a rounds log.
summarize() {
  python3 - "$1" <<'EOF'
import json, sys
name, table = None, {}
for line in open(sys.argv[1]):
    if line.startswith("== "):
        name = line[3:].split(",")[0]
    elif line.startswith("{") and name:
        row = json.loads(line)
        key = " ".join(str(row[k]) for k in ("shape", "kv_len", "tile", "sparsity") if k in row)
        if "vidattn_bwd" in row:  # the bwd stage: deterministic / fused-dQ backward [cuDNN]
            key += " bwd"
            cell = (f"{row['vidattn_bwd']:.1f} / {row.get('vidattn_nondet_bwd', float('nan')):.1f}"
                    + (f" [{row['cudnn_bwd']:.1f}]" if "cudnn_bwd" in row else ""))
        else:
            rate = row.get("vidattn_fwd", row.get("sparse_fwd"))
            if rate is None:
                continue
            cell = f"{rate:.1f}" + (f" [{row['cudnn_fwd']:.1f}]" if "cudnn_fwd" in row else "")
        table.setdefault(key, {}).setdefault(name, []).append(cell)
    elif "failed" in line:
        print(line.strip())
for key, libs in table.items():
    print(key, "|", " | ".join(f"{n}: {' / '.join(c)}" for n, c in libs.items()))
EOF
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.limit --format=csv | tee "$OUT/env.log"
for name in "${candidates[@]}"; do
  if has pytest; then
    # shellcheck disable=SC2086  # a list of files
    PYTHONPATH="$WORK/$name" timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -q -rfE \
      -p no:cacheprovider $PYTEST_FILES >"$OUT/pytest_$name.log" 2>&1
    log "$name: pytest rc=$?: $(tail -n 1 "$OUT/pytest_$name.log")"
  fi
  if has sanitizer; then
    for tool in memcheck racecheck; do
      PYTHONPATH="$WORK/$name" timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 3 \
        --kernel-name kns=vidattn python3 tools/gpu/sm90_smoke.py \
        >"$OUT/sanitizer_${tool}_$name.log" 2>&1
      log "$name: $tool rc=$?: $(grep -E 'SUMMARY' "$OUT/sanitizer_${tool}_$name.log" | tr '\n' ' ')"
    done
  fi
done
if has dense; then
  log "dense forward against cuDNN"
  # shellcheck disable=SC2086  # a list of shapes
  rounds python3 -m vidattn.bench dense --fwd-vs-cudnn --shapes $DENSE_SHAPES \
    >"$OUT/dense_ab.log" 2>&1
  summarize "$OUT/dense_ab.log"
fi
if has sparse; then
  log "block-sparse rows (ours only)"
  sparse_rows=()
  # shellcheck disable=SC2206  # a list of rows
  [[ -n ${SPARSE_ROWS:-} ]] && sparse_rows=(--sparse-rows $SPARSE_ROWS)
  rounds python3 -m vidattn.bench dense --ours-only --shapes 1,39936,12,128 "${sparse_rows[@]}" \
    >"$OUT/sparse_ab.log" 2>&1
  summarize "$OUT/sparse_ab.log"
fi
if has bwd; then
  log "backward: dense rows (deterministic / fused dQ [cuDNN]), then the block-sparse op"
  # shellcheck disable=SC2086  # a list of shapes
  rounds python3 -m vidattn.bench dense --shapes $BWD_SHAPES --sparse-rows >"$OUT/bwd_ab.log" 2>&1
  summarize "$OUT/bwd_ab.log"
  AB_FILTER='"(sparse|dense)_(fwd|bwd)_tflops"' rounds python3 -m vidattn.bench block-sparse \
    2>&1 | tee -a "$OUT/bwd_ab.log"
fi
if has vsa; then
  log "whole VSA forward"
  IFS=';' read -r -a vsa_cases <<<"$VSA_ARGS"
  for args in "${vsa_cases[@]}"; do
    # shellcheck disable=SC2086  # a list of arguments
    AB_FILTER="^== vsa|^ " AB_LINES=4 rounds python3 tools/profile/profile_vsa.py $args \
      2>&1 | tee -a "$OUT/vsa_ab.log"
  done
fi
if has cmd; then
  log "AB_CMD: ${AB_CMD:?AB_CMD=command for the cmd stage}"
  # shellcheck disable=SC2086  # a command line
  rounds $AB_CMD 2>&1 | tee "$OUT/cmd_ab.log"
fi
log "done"

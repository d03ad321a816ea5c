#!/usr/bin/env bash
# The long fuzz run on the GPU machine (issue 48): python -m vidattn.fuzz on CUDA, random
# configurations of every op against the float64 reference, the catalogue of bad inputs
# (each in a worker process: a crash counts), and a subset under compute-sanitizer memcheck.
# The summary (configurations, failures, crashes, sanitizer errors) goes to
# $OUT/fuzz-cuda.json, the log to $OUT/fuzz-cuda.log; a short CPU run beside it to
# $OUT/fuzz-cpu.json. Builds the op library first (build/fuzz, kept between calls of the same
# machine) unless LIB names a prebuilt one.
#
#   OUT=$OUT bash tools/gpu/fuzz.sh                       # build + 10,000 configurations
#   OUT=$OUT SEED=5000 COUNT=5000 SANITIZER=0 bash tools/gpu/fuzz.sh
#   OUT=$OUT COUNT=0 SANITIZER=40 bash tools/gpu/fuzz.sh  # memcheck over 40 configurations
#
# The device tool brings back at most 8 files from $OUT: run this with an OUT of its own.
# COUNT (10000), SANITIZER (configurations under memcheck, 0), SEED (0: configuration i of a
# run uses seed SEED + i, so runs with disjoint SEED ranges add up), BUDGET (seconds for the
# CUDA configurations, 480: one call of the GPU machine is 600 s at most; the summary's
# "timed_out" says whether the budget cut the run short, and "configurations" how many ran),
# CPU_COUNT (30), JOBS (nproc).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$(pwd)/fuzz-out}
mkdir -p "$OUT"
t0=$SECONDS
source tools/gpu/ops_setup.sh
install_carried_wheels
if [ -n "${LIB:-}" ]; then
  cp "$LIB" python/vidattn/_vidattn_ops.so
else
  build_ops build/fuzz || exit 1
  cp build/fuzz/_vidattn_ops.so python/vidattn/
fi
export PYTHONPATH=$(pwd)/python${PYTHONPATH:+:$PYTHONPATH}
python3 -m vidattn.fuzz --device cuda --count "${COUNT:-10000}" --seed "${SEED:-0}" \
  --time-budget "${BUDGET:-480}" --sanitizer "${SANITIZER:-0}" --json "$OUT/fuzz-cuda.json" \
  >"$OUT/fuzz-cuda.log" 2>&1
rc=$?
python3 -m vidattn.fuzz --device cpu --count "${CPU_COUNT:-30}" --seed "${SEED:-0}" \
  --json "$OUT/fuzz-cpu.json" >"$OUT/fuzz-cpu.log" 2>&1
rc_cpu=$?
# The failures by op, and the first few of each with their repro and the end of their
# message: a harness bug that fails one op everywhere must not hide another op's failures.
python3 - "$OUT/fuzz-cuda.json" <<'PY' || grep -E "^FUZZ" "$OUT/fuzz-cuda.log" | head -n 40
import collections, json, sys
failed = json.load(open(sys.argv[1]))["failed"]
by_op = collections.defaultdict(list)
for f in failed:
    job = f["job"]
    by_op[job.get("op") or job.get("type", "?")].append(f)
for op, fs in sorted(by_op.items()):
    print(f"FUZZ failures of {op}: {len(fs)}")
    for f in fs[:5]:
        detail = " ".join((f.get("detail") or "").split())
        print(f"  {f['status']}: {f['repro']}\n    ...{detail[-240:]}")
PY
tail -n 1 "$OUT/fuzz-cuda.log"
tail -n 1 "$OUT/fuzz-cpu.log"
echo "fuzz cuda rc=$rc, cpu rc=$rc_cpu at $((SECONDS - t0))s"
exit $(( rc != 0 || rc_cpu != 0 ))

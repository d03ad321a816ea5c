#!/usr/bin/env bash
# A/B runs of kernel switches on one GPU, once per setting and round, the settings alternating
# within each round so that clock and thermal drift reach all of them alike.
#   OUT=dir ROUNDS=2 bash tools/sm90_ab.sh "-" "VIDATTN_SM90_HD128_BLOCKN=176" ...
#   AB_TOOL=power SECONDS_EACH=3 bash tools/sm90_ab.sh "-" "VIDATTN_SM90_CLUSTER=0"
#   (POWER_ARGS="--cases vsa,sparse" picks power_clocks.py's workloads)
# A setting is "-" (no variable) or space-separated VAR=value pairs.
#  * AB_TOOL=bench (default): tools/bench_dense_cuda.py, vidattn's forward only (dense rows
#    and the sm_90a block-sparse rows); writes $OUT/ab_<setting index>_<round>.json and
#    prints every row's TFLOP/s per setting and round. BENCH_ARGS go to the bench, e.g.
#    BENCH_ARGS="--fwd-vs-cudnn --shapes 1,32760:512,12,128" (cuDNN's rate in brackets).
#  * AB_TOOL=power: tools/power_clocks.py (each workload back to back at the power cap:
#    call time, SM clock, board power); writes $OUT/power_<setting index>_<round>.txt and
#    prints each as it comes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/ab-run}
ROUNDS=${ROUNDS:-2}
AB_TOOL=${AB_TOOL:-bench}
mkdir -p "$OUT"
settings=("$@")
for ((r = 1; r <= ROUNDS; ++r)); do
  for i in "${!settings[@]}"; do
    s=${settings[$i]}
    [[ $s == "-" ]] && s=""
    # shellcheck disable=SC2086  # the setting is a list of VAR=value words
    if [[ $AB_TOOL == power ]]; then
      env $s timeout "${AB_TIMEOUT:-120}" python3 tools/power_clocks.py \
        --seconds "${SECONDS_EACH:-3}" ${POWER_ARGS:-} --out "$OUT/power_${i}_${r}.txt" >/dev/null \
        2>"$OUT/power_${i}_${r}.err" ||
        echo "setting $i round $r failed: $(tail -1 "$OUT/power_${i}_${r}.err")"
      echo "## setting '${settings[$i]}', round $r"
      cat "$OUT/power_${i}_${r}.txt" 2>/dev/null
    else
      # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
      env BENCH_OURS_ONLY=1 $s timeout "${AB_TIMEOUT:-90}" python3 tools/bench_dense_cuda.py \
        "$OUT/ab_${i}_${r}.json" ${BENCH_ARGS:-} >"$OUT/ab_${i}_${r}.log" 2>&1 ||
        echo "setting $i round $r failed"
    fi
  done
done
[[ $AB_TOOL == power ]] && exit 0
python3 - "$OUT" "$ROUNDS" "${settings[@]}" <<'EOF'
import json, os, sys
out, rounds, settings = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
table = {}
for i, s in enumerate(settings):
    for r in range(1, rounds + 1):
        path = os.path.join(out, f"ab_{i}_{r}.json")
        if not os.path.exists(path):
            continue
        data = json.load(open(path))
        for row in data["rows"]:
            kv = f" kv {row['kv_len']}" if "kv_len" in row else ""
            key = f"{row['shape']}{kv} {'causal' if row['causal'] else 'full'}"
            table.setdefault(key, {}).setdefault(s, []).append(
                (row.get("vidattn_fwd"), row.get("cudnn_fwd")))
        for row in data["sparse_rows"]:
            key = f"sparse {row['shape']} tile {row['tile']} s {row['sparsity']}"
            table.setdefault(key, {}).setdefault(s, []).append((row.get("sparse_fwd"), None))


def rate(ours, cudnn):
    text = f"{ours:7.1f}" if ours else "    nan"
    return text + (f" [{cudnn:5.1f}]" if cudnn else "")


for key, per in table.items():
    print(key)
    for s in settings:
        print(f"   {s:<48} " + " ".join(rate(*v) for v in per.get(s, [])))
EOF

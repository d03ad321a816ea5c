#!/usr/bin/env bash
# The whole-VSA forward rows of the gpu-suite preset (vidattn's op against cuDNN's dense
# forward, our dense forward and FastVideo's whole op) RUNS times in one GPU call, to see how
# far the ratios move between runs. One JSON per run under $OUT, then one line per row and
# run. FASTVIDEO_DIR: a folder holding fastvideo_kernel/ (tools/fastvideo_peer.sh).
#   PREBUILT_OPS=build/carry/_vidattn_ops.so OUT=$OUT RUNS=3 VIDATTN_GIT_COMMIT=<hash> \
#     FASTVIDEO_DIR=.xfer/fv bash tools/vsa_repeat_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/vsa-repeat-run}
RUNS=${RUNS:-3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)/python${FASTVIDEO_DIR:+:$FASTVIDEO_DIR}${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${PREBUILT_OPS:-}" ]; then cp "$PREBUILT_OPS" python/vidattn/_vidattn_ops.so || exit 1; fi
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/env.log"
for ((r = 1; r <= RUNS; ++r)); do
  timeout "${RUN_TIMEOUT:-200}" python3 -m vidattn.bench --no-progress --shapes gpu-suite \
    --cases vsa --directions fwd --no-plot --out "$OUT/vsa-run$r.json" >"$OUT/vsa-run$r.log" 2>&1 ||
    echo "run $r failed: $(tail -n 1 "$OUT/vsa-run$r.log")"
done
python3 - "$OUT" "$RUNS" <<'PY'
import json, os, sys
out, runs = sys.argv[1], int(sys.argv[2])
for r in range(1, runs + 1):
    path = os.path.join(out, f"vsa-run{r}.json")
    if not os.path.exists(path):
        continue
    rows = json.load(open(path))["rows"]
    ms = {}
    for row in rows:
        if row.get("status") == "ok":
            ms.setdefault(row["shape_label"], {})[row["impl"]] = row["median_ms"]
    for shape, impls in ms.items():
        ours = impls.get("vidattn-vsa")
        if ours is None:
            continue
        cells = " ".join(f"{k} {v:.3f} ms ({v / ours:.2f}x)" for k, v in impls.items()
                         if k != "vidattn-vsa")
        print(f"run {r} {shape}: vidattn-vsa {ours:.3f} ms | {cells}")
PY

#!/usr/bin/env bash
# One GPU-machine call for the sm_90a backward, within the device tool's 10 minutes a call:
# builds the op library when build/branch has none yet (tools/gpu/branch_check.sh; a warm
# machine keeps it between calls), then runs the stages named in STAGES, each with a time
# limit that leaves room for the ones after it:
#   smoke     tools/gpu/sm90_bwd_smoke.py (60 s: a hang in a new kernel stops here)
#   pytest    PYTEST_PATHS (default tests/python/test_attention_sm90_backward.py)
#   dense     python -m vidattn.bench dense on the backward's target shapes -> $OUT/dense.json
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck on the smoke script
#   peers     the case runner on the block-sparse backward rows (BLOCKSPARSE_SHAPES) with
#             FastVideo's Triton (FASTVIDEO_DIR, default .xfer/fv) and ThunderKittens
#             (built from TK_DIR, default build/tk, by tools/peers/thunderkittens_peer.sh)
#             kernels and FlexAttention -> $OUT/blocksparse-bwd.json
#   vsa       the case runner on the whole VSA op (VSA_SHAPES, default vsa-480p; vsa-video adds
#             Wan 720p), both directions, against cuDNN dense on the same tensors and
#             FastVideo's VSA op -> $OUT/vsa.json
#   suite     the case runner on SUITE_SHAPES (default gpu-suite), both directions
#             -> $OUT/gpu-suite.json
#   OUT=$OUT STAGES="smoke pytest dense" bash tools/gpu/bwd_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$(pwd)/bwd-check}
STAGES=${STAGES:-"smoke pytest dense"}
mkdir -p "$OUT"
t0=$SECONDS
has() { [[ " $STAGES " == *" $1 "* ]]; }
if [ ! -f build/branch/_vidattn_ops.so ]; then
  OUT=$OUT PYTEST_PATHS= BENCH= bash tools/gpu/branch_check.sh || exit 1
else
  source tools/gpu/ops_setup.sh
  install_carried_wheels
  cp build/branch/_vidattn_ops.so python/vidattn/
fi
export PYTHONPATH=$(pwd)/python:/tmp/vidattn-site:$(pwd)/${FASTVIDEO_DIR:-.xfer/fv}
# The ThunderKittens peer builds on the CPUs while the GPU stages run.
tk_pid=
if { has peers || has suite; } && [ ! -f "${TK_DIR:-build/tk}/tk_vsa.so" ]; then
  # The GPU machine has no shared/: build from the sources a --copy-only run left in TK_DIR.
  if [ -z "${TK_SRC:-}" ] && [ -d "${TK_DIR:-build/tk}/src" ]; then
    rm -rf /tmp/tk-src && cp -r "${TK_DIR:-build/tk}/src" /tmp/tk-src && export TK_SRC=/tmp/tk-src
  fi
  bash tools/peers/thunderkittens_peer.sh "${TK_DIR:-build/tk}" >"$OUT/tk-build.log" 2>&1 &
  tk_pid=$!
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
echo "ready at $((SECONDS - t0))s"
if has smoke; then
  timeout 60 python3 tools/gpu/sm90_bwd_smoke.py 2>&1 | tail -n 5
  echo "smoke rc=${PIPESTATUS[0]} at $((SECONDS - t0))s"
fi
if has pytest; then
  timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest \
    ${PYTEST_PATHS:-tests/python/test_attention_sm90_backward.py} -q -rfE -p no:cacheprovider \
    >"$OUT/pytest.log" 2>&1
  echo "pytest rc=$? at $((SECONDS - t0))s: $(tail -n 1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20
fi
if has dense; then
  timeout "${DENSE_TIMEOUT:-200}" python3 -m vidattn.bench dense --shapes ${DENSE_SHAPES:-\
1,39936,12,128 2,16384,32,64 1,16384,12,128,causal 1,92160,40,128} \
    --sparse-rows --out "$OUT/dense.json" >"$OUT/dense.log" 2>&1
  echo "dense rc=$? at $((SECONDS - t0))s"
  grep -v '^{' "$OUT/dense.log" | tail -n 8
fi
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool $tool --print-limit 5 python3 tools/gpu/sm90_bwd_smoke.py \
      >"$OUT/$tool.log" 2>&1
    echo "$tool rc=$? at $((SECONDS - t0))s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -n 1)"
  done
fi
if has peers || has suite; then
  if [ -n "$tk_pid" ]; then
    wait "$tk_pid"
    echo "tk build rc=$? at $((SECONDS - t0))s"
  fi
  export VIDATTN_TK_VSA=$(pwd)/${TK_DIR:-build/tk}/tk_vsa.so
fi
if has peers; then
  timeout "${PEERS_TIMEOUT:-300}" python3 -m vidattn.bench --cases blocksparse --directions bwd \
    --shapes ${BLOCKSPARSE_SHAPES:-b1h12s39936d128sp0.875,b1h12s39936d128sp0.9} --ref-heads 1 --no-progress \
    --out "$OUT/blocksparse-bwd.json" >"$OUT/peers.log" 2>&1
  echo "peers rc=$? at $((SECONDS - t0))s"
  tail -n 20 "$OUT/peers.log"
fi
if has vsa; then
  timeout "${VSA_TIMEOUT:-240}" python3 -m vidattn.bench --cases vsa --shapes ${VSA_SHAPES:-vsa-480p} \
    --directions fwd,bwd --ref-heads 1 --no-progress --out "$OUT/vsa.json" >"$OUT/vsa.log" 2>&1
  echo "vsa rc=$? at $((SECONDS - t0))s"
  tail -n 16 "$OUT/vsa.log"
fi
if has suite; then
  timeout "${SUITE_TIMEOUT:-400}" python3 -m vidattn.bench --shapes ${SUITE_SHAPES:-gpu-suite} \
    --no-progress --out "$OUT/gpu-suite.json" >"$OUT/suite.log" 2>&1
  echo "suite rc=$? at $((SECONDS - t0))s"
  tail -n 40 "$OUT/suite.log"
fi

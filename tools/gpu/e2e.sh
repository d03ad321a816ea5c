#!/usr/bin/env bash
# One GPU-machine call for the whole-model numbers of issue 47: one denoising step of
# diffusers' Wan transformer (python -m vidattn.bench --e2e, python/vidattn/bench/e2e_case.py),
# sized to finish in under 8 minutes on one H100 (80 GB):
#   wan2.1-1.3b-480p  inference at full depth (30 blocks); training (forward + backward) at
#                     TRAIN_LAYERS_1_3B blocks (default 8: without gradient checkpointing
#                     the 30 blocks' activations at 480p, ~5 GB a block, do not fit 80 GB)
#   wan2.1-14b-720p   inference at LAYERS_14B blocks (default 4: 40 blocks take ~12 s a step
#                     and the run would not fit the time); training at TRAIN_LAYERS_14B
#                     blocks (default 1: ~35 GB of activations a block at 720p; 0 skips it)
# for every implementation of the issue: diffusers' default, SDPA forced to cuDNN, vidattn
# dense, vidattn VSA at SPARSITY (0.9), and VSA with the blocks run in tile order
# (vidattn-vsa-tiled, retile="forward"), each with one profiled step for the attention share.
# A row timed below the full depth reports the measured step, the per-block time
# (T_N - T_0) / N against a 0-block model and the full-depth step extrapolated from it,
# marked "full_depth_extrapolated": true in the JSON and "extrapolated from N layers" in the
# PNG: those are per-layer-scaled numbers, not measured full-depth steps.
#
#   OUT=$OUT bash tools/gpu/e2e.sh            -> $OUT/<device>/e2e.json + e2e.png, $OUT/e2e.log
#   OUT=$OUT DRY_RUN=1 bash tools/gpu/e2e.sh  # the tiny model on the CPU (CI's check of this)
#
# The results folder has bench/results' layout: copy $OUT/<device>/ into bench/results/.
# The op library: $PACKAGE_DIR/vidattn/_vidattn_ops.so if there, else PREBUILT_OPS, else
# build/branch/_vidattn_ops.so (a warm machine's), else built by tools/gpu/build_ops.sh (not
# counted in the 8 minutes). diffusers==0.42.1 and its dependencies come from the wheels in
# .whl/ where the machine has no network. E2E_TIMEOUT (s, 450), PYTHON (python3),
# IMPLS, SPARSITY, EXTRA_ARGS (more arguments of --e2e).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$(pwd)/e2e-run}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
t0=$SECONDS
source tools/gpu/ops_setup.sh
install_carried_wheels
# PACKAGE_DIR: the folder that holds the vidattn package to run (default: this tree's python/;
# CI's test of this script passes the installed one).
PACKAGE_DIR=${PACKAGE_DIR:-$(pwd)/python}
if [ ! -f "$PACKAGE_DIR/vidattn/_vidattn_ops.so" ]; then
  if [ -n "${PREBUILT_OPS:-}" ]; then
    cp "$PREBUILT_OPS" "$PACKAGE_DIR/vidattn/_vidattn_ops.so" || exit 1
  else
    [ -f build/branch/_vidattn_ops.so ] || build_ops build/branch || exit 1
    cp build/branch/_vidattn_ops.so "$PACKAGE_DIR/vidattn/"
  fi
fi
export PYTHONPATH=$PACKAGE_DIR${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
IMPLS=${IMPLS:-diffusers-default,sdpa-cudnn,vidattn-dense,vidattn-vsa,vidattn-vsa-tiled}
if [ -n "${DRY_RUN:-}" ]; then
  MODELS=tiny
  LAYERS="tiny:training=1"
  DEVICE_ARGS="--device cpu --repeats 1"
else
  MODELS=wan2.1-1.3b-480p,wan2.1-14b-720p
  LAYERS="wan2.1-1.3b-480p:training=${TRAIN_LAYERS_1_3B:-8},wan2.1-14b-720p:inference=${LAYERS_14B:-4}"
  LAYERS="$LAYERS,wan2.1-14b-720p:training=${TRAIN_LAYERS_14B:-1}"
  DEVICE_ARGS=""
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
fi
# Each model's directions run at their own depth (one model build per depth).
DIRECTIONS=inference,training
echo "ready at $((SECONDS - t0))s"
timeout --kill-after=10 "${E2E_TIMEOUT:-450}" $PYTHON -m vidattn.bench --e2e \
  --e2e-models "$MODELS" --e2e-layers "$LAYERS" --impls "$IMPLS" --directions "$DIRECTIONS" \
  --sparsity "${SPARSITY:-0.9}" --out-dir "$OUT" $DEVICE_ARGS ${EXTRA_ARGS:-} \
  >"$OUT/e2e.log" 2>&1
rc=$?
echo "e2e rc=$rc at $((SECONDS - t0))s"
grep -vE '^(\{|W[0-9]{4}|ERROR:.*gpuGetDeviceCount)' "$OUT/e2e.log" | tail -n 40
exit $rc

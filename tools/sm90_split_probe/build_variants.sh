#!/usr/bin/env bash
# Builds the two probe libraries of the 64-token block-sparse kernel (README.md here):
#   bash tools/sm90_split_probe/build_variants.sh BUILD_DIR OUT_DIR [TU_GLOB]
# BUILD_DIR: a configured and built op-library tree (build/cp311-cp311-linux_x86_64 from
# tools/dev_build.sh). The probe instances (TU_GLOB, default the bf16 D = 128 sparse ones) are
# compiled from a patched copy of src/ with the sm_90a target only; every other object is
# BUILD_DIR's. Writes OUT_DIR/{loadonly,noloads}/_vidattn_ops.so. Needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
BUILD=$(realpath "${1:?BUILD_DIR}")
OUT=$(realpath -m "${2:?OUT_DIR}")
GLOB=${3:-sm90_fwd_bf16_hd128_sparse*}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/tree"
cp -r src include "$WORK/tree/"
(cd "$WORK/tree" && git apply "$ROOT/tools/sm90_split_probe/split.patch")
commands=$(cd "$BUILD" && ninja -t commands _vidattn_ops.so)
tus=$(cd src/cuda/sm90 && ls $GLOB)
[[ -n $tus ]] || { echo "build_variants: no source matches $GLOB" >&2; exit 2; }
for variant in loadonly:VIDATTN_PROBE_LOAD_ONLY noloads:VIDATTN_PROBE_NO_KV_LOADS; do
  name=${variant%%:*}; define=${variant#*:}
  mkdir -p "$WORK/$name" "$OUT/$name"
  for tu in $tus; do
    obj=${tu}.o  # the archive's member name
    cmd=$(grep -F -- "-c $ROOT/src/cuda/sm90/$tu " <<<"$commands" | head -1)
    [[ -n $cmd ]] || { echo "build_variants: $tu is not in $BUILD's commands" >&2; exit 2; }
    # sm_90a only (the kernels exist for it alone); no depfile; patched sources; own output.
    cmd=$(sed -e 's/-gencode=arch=compute_80,code=sm_80//' -e 's/-MD -MT [^ ]* -MF [^ ]*//' \
              -e "s# -o [^ ]*\$# -o $WORK/$name/$obj#" \
              -e "s#-I$ROOT/include#-I$WORK/tree/include#" \
              -e "s#-c $ROOT/src/#-c $WORK/tree/src/#" <<<"$cmd")
    (cd "$BUILD" && eval "$cmd -D$define")
  done
  cp "$BUILD/libvidattn.a" "$WORK/$name/libvidattn.a"
  (cd "$WORK/$name" && ar r libvidattn.a ./*.cu.o)
  link=$(tail -1 <<<"$commands" | sed -e "s# libvidattn.a # $WORK/$name/libvidattn.a #" \
                                      -e "s# -o _vidattn_ops.so # -o $OUT/$name/_vidattn_ops.so #")
  (cd "$BUILD" && eval "$link")
  echo "built $OUT/$name/_vidattn_ops.so"
done

#!/usr/bin/env bash
# Builds FastVideo's ThunderKittens Hopper block-sparse kernel (the VSA peer with 64-token
# tiles) as a torch extension in DEST, from the third-party sources kept beside the project in
# shared/peers/thunderkittens-vsa/ (their README says what the module offers). The sources are
# copied to DEST/src and built there, so nothing of them ever lands in tracked files: DEST is
# outside the checkout or a git-ignored folder in it (build/..., say).
#   tools/peers/thunderkittens_peer.sh DEST              # copy and build (sm_90a: nvcc, ninja,
#                                                        # a CUDA torch; ~70 s on 16 cores)
#   tools/peers/thunderkittens_peer.sh DEST --copy-only  # copy only, e.g. on a CPU machine
#                                                        # before carrying DEST to a GPU one
# Then DEST/tk_vsa.so loads as a Python extension module named tk_vsa (fwd, bwd).
# TK_SRC=DIR names the sources elsewhere; PYTHON picks the interpreter (python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${1:?usage: tools/peers/thunderkittens_peer.sh DEST [--copy-only]}
MODE=${2:-build}
PYTHON=${PYTHON:-python3}
SRC=${TK_SRC:-}
if [[ -z $SRC ]]; then
  for candidate in "$root/shared/peers/thunderkittens-vsa" "$root/../shared/peers/thunderkittens-vsa"; do
    [[ -f $candidate/build.py ]] && { SRC=$candidate; break; }
  done
fi
[[ -n $SRC && -f $SRC/build.py ]] || {
  echo "thunderkittens_peer: no sources (shared/peers/thunderkittens-vsa/build.py); set TK_SRC" >&2
  exit 2
}
DEST=$(realpath -m "$DEST")
# Inside the checkout only where git ignores it: the peer's code must never be committed.
case "$DEST/" in
  "$root"/*)
    if ! git -C "$root" check-ignore -q "$DEST"; then
      echo "thunderkittens_peer: $DEST is inside the checkout and not git-ignored;" \
        "use an ignored folder (build/..., say) or one outside it" >&2
      exit 2
    fi
    ;;
esac
mkdir -p "$DEST"
rm -rf "$DEST/src"
cp -r "$SRC" "$DEST/src"
echo "thunderkittens-vsa sources in $DEST/src"
if [[ $MODE == --copy-only ]]; then
  exit 0
elif [[ $MODE != build ]]; then
  echo "thunderkittens_peer: unknown option $MODE (expected --copy-only)" >&2
  exit 2
fi
"$PYTHON" "$DEST/src/build.py" "$DEST"
ls "$DEST"/tk_vsa*.so >/dev/null
echo "tk_vsa in $DEST (PYTHONPATH=$DEST, import tk_vsa)"

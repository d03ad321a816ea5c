#!/usr/bin/env bash
# A/B of op libraries on the whole VSA forward: tools/profile_vsa.py (kernel time per forward
# and the largest kernels) once per library and round, the libraries alternating within each
# round so that clock and thermal drift reach all of them alike.
#   ROUNDS=2 bash tools/vsa_lib_ab.sh new=build/x/_vidattn_ops.so \
#       old=/tmp/old/_vidattn_ops.so@/tmp/old-tree/python -- --grid 21x45x80 --heads 40
# Each library runs with its own Python package (LIB@DIR: DIR holds vidattn/; default this
# tree's python/), copied to a private folder: a library built from another commit may lack
# an op the newer Python calls, and the tree's own python/vidattn is never overwritten.
# Arguments after -- go to profile_vsa.py (default: Wan 480p, --iters 10).
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
names=()
while (($#)) && [[ $1 != "--" ]]; do
  spec=$1; shift
  name=${spec%%=*}; rest=${spec#*=}
  lib=${rest%%@*}; pydir=$(pwd)/python
  [[ $rest == *@* ]] && pydir=${rest#*@}
  if [[ $name == "$spec" || ! -f $lib || ! -d $pydir/vidattn ]]; then
    echo "vsa_lib_ab: expected NAME=LIB.so[@PYTHON_DIR] with an existing library and" \
      "DIR/vidattn, got '$spec'" >&2
    exit 2
  fi
  mkdir -p "$WORK/$name"
  cp -r "$pydir/vidattn" "$WORK/$name/"
  rm -f "$WORK/$name"/vidattn/*.so
  cp "$lib" "$WORK/$name/vidattn/_vidattn_ops.so"
  names+=("$name")
done
[[ ${1:-} == "--" ]] && shift
args=("$@")
((${#args[@]})) || args=(--iters 10)
((${#names[@]})) || { echo "vsa_lib_ab: no libraries given" >&2; exit 2; }
for ((r = 1; r <= ROUNDS; ++r)); do
  for name in "${names[@]}"; do
    echo "== $name, round $r"
    PYTHONPATH="$WORK/$name" timeout "${AB_TIMEOUT:-120}" python3 tools/profile_vsa.py \
      "${args[@]}" 2>&1 | grep -E "^== vsa|^ " | head -4 || echo "$name round $r failed"
  done
done
